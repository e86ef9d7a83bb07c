"""EPConfig: derived sizes and one clear error per rule."""

import pytest

from moonep_ops import EPConfig

OK = dict(S=8192, H=7168, K=8, E=96, F=2048, R=2)


def test_derived_sizes():
    c = EPConfig(**OK)
    assert (c.epn, c.B, c.G, c.P) == (48, 48, 96, 128)
    assert c.NvS == 77824 == -(-(8192 * 8 + 127 * 96) // 128) * 128
    # inference B=3: 48 home + 3 slot + 45 remote groups, the same rows as training
    assert (EPConfig(**OK, B=3).G, EPConfig(**OK, B=3).NvS) == (96, 77824)
    # one rank: no copies and no remote reads, so only the 48 home groups are ever padded
    one = EPConfig(**dict(OK, E=48, R=1))
    assert (one.G, one.padded_groups, one.NvS) == (96, 48, 71680) and one.NvS == -(-(8192 * 8 + 127 * 48) // 128) * 128


@pytest.mark.parametrize("override, match", [
    (dict(E=95), r"EPConfig.E must be a positive multiple of R .* E=95, R=2"),
    (dict(E=0), r"EPConfig.E must be a positive multiple of R"),
    (dict(H=7170), r"EPConfig.H must be a positive multiple of 8 .*16-byte.* H=7170"),
    (dict(H=0), r"EPConfig.H must be a positive multiple of 8"),
    (dict(F=12), r"EPConfig.F must be a positive multiple of 8 .* F=12"),
    (dict(K=0), r"EPConfig.K must be in \[1, min\(E, 32\)\] = \[1, 32\], got K=0"),
    (dict(K=33), r"EPConfig.K must be in \[1, min\(E, 32\)\] = \[1, 32\], got K=33"),
    (dict(E=4, R=2, K=5), r"EPConfig.K must be in \[1, min\(E, 32\)\] = \[1, 4\], got K=5"),
    (dict(S=0), r"EPConfig.S must be >= 1, got S=0"),
    (dict(S=2**20, K=32, R=64, E=6400), r"EPConfig: S\*K\*R must be < 2\*\*31"),
    (dict(B=-1), r"EPConfig.B must be in \[0, epn\] = \[0, 48\], got B=-1"),
    (dict(B=49), r"EPConfig.B must be in \[0, epn\] = \[0, 48\], got B=49"),
    (dict(P=96), r"EPConfig.P must be a power of two >= 16, got P=96"),
    (dict(P=8), r"EPConfig.P must be a power of two >= 16, got P=8"),
    (dict(R=0), r"EPConfig.R must be >= 1"),
    (dict(S=8.0), r"EPConfig.S must be an int, got float"),
    (dict(B=2.0), r"EPConfig.B must be an int or None, got float"),
])
def test_rules(override, match):
    with pytest.raises(ValueError, match=match):
        EPConfig(**{**OK, **override})


def test_boundaries_accepted():
    EPConfig(**{**OK, "B": 0})
    EPConfig(**{**OK, "P": 16})
    EPConfig(S=1, H=8, K=1, E=1, F=8, R=1)
    EPConfig(S=2**20, K=32, R=63, E=63 * 32, H=8, F=8)  # S*K*R = 2**31 - 2**25 < 2**31
