"""The design card's `meta/`: the fake (meta) kernels of the moonep ops.

They live in `moonep_ops/fake/` (one module per op, `fake/<op>.py` for `moonep::<op>`) so that they
install inside the `moonep_ops` distribution: a top-level package named `meta` in site-packages is a
generic name another distribution can own too. This thin package keeps the design card's layout for a
source checkout (`meta.<op>` is `moonep_ops.fake.<op>`) and is not installed (pyproject.toml).
"""

from moonep_ops.fake import *  # noqa: F401,F403
from moonep_ops.fake import __all__  # noqa: F401
