"""Fake kernel of moonep::reduce_grad."""

from ..checks import check_reduce_args


def reduce_grad(experts_to_copy, reduce_gate, reduce_up, reduce_down, home_gate, home_up, home_down, ctrl,
                group_name: str) -> None:
    check_reduce_args(experts_to_copy, (reduce_gate, reduce_up, reduce_down), (home_gate, home_up, home_down), ctrl)
