"""Fake kernel of moonep::prefetch_weights."""

from ..checks import check_prefetch_args


def prefetch_weights(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl,
                     group_name: str) -> None:
    check_prefetch_args(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl)
