"""Device status word: int32 bits that kernels OR in instead of failing (no host sync on the hot path).

`moonep_ops.check_status` reads the word (a deliberate host sync) and raises with these messages.
"""

STATUS_BAD_EXPERT_ID = 1      # a topk id outside [0, E): not counted, its row gets -1
STATUS_SLOT_OVERFLOW = 2      # a rank needs more than B copied experts (CPU reference raises)
STATUS_BAD_COUNTS = 4         # counts negative or a row sum != S*K (CPU reference raises)
STATUS_COUNTS_MISMATCH = 8    # plan_tokens: topk_ids histogram != counts[rank]
STATUS_BAD_PLAN = 16          # plan_tokens: a row's position lies past its expert's alloc

MESSAGES = {
    STATUS_BAD_EXPERT_ID: "topk_ids held an expert id outside [0, E); those rows were routed nowhere",
    STATUS_SLOT_OVERFLOW: "a rank needed more copied experts than its B slots; the plan is incomplete "
                          "(B = epn always suffices)",
    STATUS_BAD_COUNTS: "the count matrix had a negative entry or a rank whose counts do not sum to S*K",
    STATUS_COUNTS_MISMATCH: "this rank's topk_ids do not match its row of the count matrix",
    STATUS_BAD_PLAN: "a token's position lies past its expert's allocation (inconsistent plan inputs)",
}
