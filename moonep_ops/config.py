"""Static configuration of one expert-parallel MoE layer family.

Every shape in the library derives from an `EPConfig`: the receive buffer, the plan tensors, the
kernel grids. Nothing depends on the routing, which is what keeps the compiled graph and the memory
footprint identical at any skew.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rows of H or F elements are moved as 16-byte vectors (8 bf16): a multiple of 8 keeps every row
# start 16-byte aligned, which TMA and vectorised NVLink stores need.
ROW_ALIGN_ELEMS = 8
MAX_TOPK = 32


INT32_LIMIT = 2**31


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def receive_rows(S: int, K: int, P: int, G: int) -> int:
    """NvS: receive rows per rank, S*K real rows plus the worst-case padding of every one of G groups."""
    return align_up(S * K + (P - 1) * G, P)


def check_int32_tables(where: str, S: int, K: int, R: int, E: int, P: int) -> None:
    """Every size the int32 plan and row tables hold must fit: rows routed by all ranks (S*K*R, also
    the bound of the sources rank*S + token), receive rows per rank (NvS: rows, cu_seqlens), and the
    control block (its R*E count matrix, twice)."""
    from csrc_cute.status import control_words

    sizes = (("S*K*R", "routed rows of all ranks", S * K * R),
             ("NvS", "receive rows per rank, align_up(S*K + (P-1)*2*E/R, P)", receive_rows(S, K, P, 2 * (E // R))),
             ("the control block", "2*R*E count words and the signals", control_words(R, E)))
    for name, what, v in sizes:
        if v >= INT32_LIMIT:
            raise ValueError(f"{where}: {name} must be < 2**31 ({what}; int32 tables), got {name}={v}")


@dataclass(frozen=True)
class EPConfig:
    """Shapes of an EP MoE layer.

    S: tokens per rank (the same on every rank); H: hidden size; K: routed experts per token;
    E: routed experts in the EP group; F: expert FFN intermediate size; R: EP ranks;
    P: row padding of each expert group; B: copy slots per rank (default: epn, enough for any
    routing; training needs it). Inference may use a small B such as 3-4: the copies that get no
    slot are read from their home rank's weights through the peer mapping.
    """

    S: int
    H: int
    K: int
    E: int
    F: int
    R: int
    P: int = 128
    B: int | None = None

    def __post_init__(self):
        for name in ("S", "H", "K", "E", "F", "R", "P"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"EPConfig.{name} must be an int, got {type(v).__name__}")
        if self.R < 1:
            raise ValueError(f"EPConfig.R must be >= 1, got R={self.R}")
        if self.E < 1 or self.E % self.R != 0:
            raise ValueError(
                f"EPConfig.E must be a positive multiple of R (every rank owns E/R home experts), "
                f"got E={self.E}, R={self.R}")
        if self.S < 1:
            raise ValueError(f"EPConfig.S must be >= 1, got S={self.S}")
        if self.K < 1 or self.K > min(self.E, MAX_TOPK):
            raise ValueError(
                f"EPConfig.K must be in [1, min(E, {MAX_TOPK})] = [1, {min(self.E, MAX_TOPK)}], "
                f"got K={self.K}")
        for name in ("H", "F"):
            v = getattr(self, name)
            if v < ROW_ALIGN_ELEMS or v % ROW_ALIGN_ELEMS != 0:
                raise ValueError(
                    f"EPConfig.{name} must be a positive multiple of {ROW_ALIGN_ELEMS} "
                    f"(rows move as 16-byte vectors of bf16), got {name}={v}")
        if self.P < 16 or self.P & (self.P - 1):
            raise ValueError(f"EPConfig.P must be a power of two >= 16, got P={self.P}")
        check_int32_tables("EPConfig", self.S, self.K, self.R, self.E, self.P)
        if self.B is None:
            object.__setattr__(self, "B", self.epn)
        if isinstance(self.B, bool) or not isinstance(self.B, int):
            raise ValueError(f"EPConfig.B must be an int or None, got {type(self.B).__name__}")
        if self.B < 0 or self.B > self.epn:
            raise ValueError(f"EPConfig.B must be in [0, epn] = [0, {self.epn}], got B={self.B}")

    @property
    def epn(self) -> int:
        """Home experts per rank."""
        return self.E // self.R

    @property
    def G(self) -> int:
        """Expert groups in a rank's receive buffer: epn home experts, B slots, epn - B remote reads
        (a rank's copies come from one donor group, so epn foreign groups always suffice)."""
        return 2 * self.epn

    @property
    def padded_groups(self) -> int:
        """The groups whose padding a rank's receive rows must hold: all G with R > 1; with R = 1 the epn
        home groups alone, since a one-rank plan copies nothing and reads nothing remotely (its slot and
        remote groups are empty, so they are not padded either)."""
        return self.G if self.R > 1 else self.epn

    @property
    def NvS(self) -> int:
        """Receive rows per rank: S*K real rows plus the worst-case padding of every group that can hold
        rows (`padded_groups`)."""
        return receive_rows(self.S, self.K, self.P, self.padded_groups)
