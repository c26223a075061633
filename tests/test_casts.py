"""The converter casts bf16 ↔ f16 directly; that must equal the exact route through f32."""

import ml_dtypes
import numpy as np
import pytest


@pytest.mark.parametrize("src, dst", [(ml_dtypes.bfloat16, np.float16), (np.float16, ml_dtypes.bfloat16)])
def test_direct_cast_equals_the_route_through_f32_on_every_input(src, dst):
    x = np.arange(65536, dtype=np.uint16).view(src)
    with np.errstate(all="ignore"):
        direct = x.astype(dst)
        via_f32 = x.astype(np.float32).astype(dst)
    nan = np.isnan(via_f32.astype(np.float32))
    assert np.array_equal(direct.view(np.uint16)[~nan], via_f32.view(np.uint16)[~nan])
    assert np.isnan(direct.astype(np.float32)[nan]).all()
