"""What the kernel tests share: device, dtypes, tolerances against float64, poisoned buffers."""
import math

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Against a float64 reference. bf16 allows for two roundings per output, each a whole
# ulp under the CPU interpreter, which truncates float32 to bfloat16 instead of rounding.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, terms: int = 0) -> None:
    """terms: the length of the sums behind each value (a projection's K). float32's tolerance grows
    from K = 256 on with its square root, as the rounding error of a float32 sum does."""
    tol = dict(TOLERANCE[actual.dtype])
    if actual.dtype == torch.float32 and terms > 256:
        tol["atol"] *= math.sqrt(terms / 256)
    torch.testing.assert_close(actual.double(), expected.double(), **tol)


def poisoned_view(rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    """A random [rows, cols] view into a larger NaN buffer: a kernel that reads past the
    view's edges turns its results into NaN, one that writes past them overwrites NaN."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((rows + 2, cols + 8), math.nan, dtype=dtype)
    buf[:rows, :cols] = torch.randn(rows, cols, generator=gen).to(dtype)
    return buf.to(DEVICE)[:rows, :cols]  # its _base is the whole buffer


def poison_intact(view: torch.Tensor) -> bool:
    """Whether everything of the view's buffer outside the view is still NaN."""
    buf = view._base
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
    return bool(buf[outside].isnan().all())
