"""Device status word (int32 bits that kernels OR in instead of failing: no host sync on the hot path)
and the layout of the EP group's control block that holds it.

`moonep_ops.check_status` reads the word (a deliberate host sync) and raises with these messages.
"""

STATUS_BAD_EXPERT_ID = 1      # a topk id outside [0, E) and not -1, or a token mixing -1 (absent) with ids
# bit 2 is unused: it meant "slot overflow", which cannot happen since slotless copies are read remotely
STATUS_BAD_COUNTS = 4         # counts negative or a row sum > S*K (CPU reference raises)
STATUS_COUNTS_MISMATCH = 8    # plan_tokens: topk_ids histogram != counts[rank]
STATUS_BAD_PLAN = 16          # plan_tokens: a row has no place in the plan (inconsistent inputs)
STATUS_TIMEOUT = 32           # a cross-rank barrier gave up waiting for a peer
STATUS_OP_MISMATCH = 64       # ranks met at a barrier / agreement point from different moonep ops
STATUS_BAD_TABLE = 128        # an index table entry was out of range: the kernel skipped it
STATUS_PEER_REJECTED = 256    # CPU: a peer rejected its arguments to the same op (it raised the reason)

MESSAGES = {
    STATUS_BAD_EXPERT_ID: "topk_ids held an expert id outside [0, E) other than -1, or a token mixed the "
                          "absent-token marker -1 with expert ids; those rows were routed nowhere",
    STATUS_BAD_COUNTS: "the count matrix had a negative entry or a rank whose counts sum to more than S*K",
    STATUS_COUNTS_MISMATCH: "this rank's topk_ids do not match its row of the count matrix",
    STATUS_BAD_PLAN: "a token's position lies past its expert's allocation, or its destination holds no "
                     "group of its expert (inconsistent plan inputs)",
    STATUS_TIMEOUT: "a cross-rank barrier timed out: a peer never arrived (a rank skipped a collective "
                    "moonep op, crashed, or runs a different op order); this EP group is unusable now",
    STATUS_OP_MISMATCH: "ranks reached the same synchronisation point from different moonep ops (a rank "
                        "skipped or repeated an op); destroy and rebuild this EP group",
    STATUS_BAD_TABLE: "an index table (dst_rank/dst_row/primary_row, row_primary/row_next, experts_to_copy) "
                      "held an entry out of range; the kernel skipped it instead of reading or writing there",
    STATUS_PEER_REJECTED: "a peer rejected its arguments to the same op (it raised the reason); nothing was "
                          "written, every rank may continue with the next op",
}

# Op ids that the CPU agreement exchange and the GPU barriers carry (a rank that skipped or repeated an
# op meets its peers with another id). Append only: the id is part of the ranks' contract.
OP_IDS = {name: i + 1 for i, name in enumerate((
    "plan", "dispatch", "combine", "gather_row_weights", "prefetch_weights", "reduce_grad",
    "group_gemm_swiglu", "group_gemm_row_scale", "dispatch (received tables)", "dispatch_index",
    "dispatch_index (received tables)"))}
OP_NAMES = {i: name for name, i in OP_IDS.items()}


# The EP group's control block: one symmetric int32 buffer per group, shared by every comm kernel.
#   [STATUS_WORD]            this rank's status bits (check_status reads them)
#   [EPOCH_WORD]             barriers passed so far (advanced on the device: CUDA-graph replays work)
#   [OP_COUNT_WORD]          CPU: collective moonep ops run so far (the agreement counter; the GPU's is
#                            the epoch)
#   [TIMEOUT_MS_WORD]        CPU: EPGroup.timeout_s in ms, how long an agreement exchange waits (0: default)
#   [MISMATCH_WORD]          GPU: (this rank's op id << 16) | the peer's, at the first barrier where the
#                            ids differed (with STATUS_OP_MISMATCH)
#   [SIGNAL_BASE + r]        (epoch << 8) | op id of the barrier rank r last signalled to this rank
#                            (written by rank r; one word, so the epoch and its op id land together)
#   [counts_base(R, E, p) + r*E]  rank r's expert counts, landed by rank r's count exchange whose
#                                  barrier epoch has parity p. Two landing zones: a peer can run at
#                                  most one barrier ahead, so its next exchange never overwrites the
#                                  counts this rank is still copying out.
STATUS_WORD = 0
EPOCH_WORD = 1
OP_COUNT_WORD = 2
TIMEOUT_MS_WORD = 3
MISMATCH_WORD = 4
DEFAULT_TIMEOUT_S = 30.0   # how long a cross-rank wait spins before it reports STATUS_TIMEOUT
DEFAULT_COMM_SMS = 32      # CTAs (one per SM) of the communication kernels
SIGNAL_BASE = 32


def counts_base(R: int, E: int, parity: int = 0) -> int:
    return SIGNAL_BASE + (R + 31) // 32 * 32 + parity * R * E


def control_words(R: int, E: int) -> int:
    """Size in int32 words of the control block of an EP group of R ranks and E experts."""
    return counts_base(R, E, 2)
