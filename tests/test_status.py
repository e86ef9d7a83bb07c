"""check_status decodes every status bit the kernels set into one clear error."""

import re

import pytest
import torch

from csrc_cute import status as bits
from moonep_ops.status import MoEStatusError, check_status


def test_clean_status_passes():
    check_status(torch.zeros(1, dtype=torch.int32))


def test_each_bit_named_and_reset():
    for bit, msg in bits.MESSAGES.items():
        status = torch.tensor([bit], dtype=torch.int32)
        with pytest.raises(MoEStatusError, match=re.escape("after plan: " + msg)) as info:
            check_status(status, "plan")
        assert info.value.code == bit and int(status[0]) == 0


def test_several_bits_and_unknown_bits():
    code = bits.STATUS_BAD_EXPERT_ID | bits.STATUS_COUNTS_MISMATCH | 1024
    with pytest.raises(MoEStatusError) as info:
        check_status(torch.tensor([code], dtype=torch.int32), reset=False)
    text = str(info.value)
    assert "expert id outside [0, E)" in text and "do not match its row of the count matrix" in text
    assert "unknown status bits 0x400" in text
