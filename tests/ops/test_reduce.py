"""Reductions over any set of dims: every op and dtype against float64, indices, NaN, split rows,
layouts, gradients, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tritondnn.ops.reduce as rd
from helpers import DEVICE, DTYPES, LAYOUTS, assert_close, randn

OPS = list(rd.OPS)
DIMS = [None, 1, (0, 2), -1, (1, 2)]


def _torch_same_dtype(x: torch.Tensor, op: str, dims) -> torch.Tensor:
    """PyTorch's own result in x's dtype (the accuracy rule's baseline)."""
    d = tuple(dims) if dims else tuple(range(x.ndim))
    if op in ("mul", "mul_no_zeros"):
        flat = rd._to_matrix_reference(x, d)
        if op == "mul_no_zeros":
            flat = torch.where(flat == 0, torch.ones_like(flat), flat)
        return flat.prod(1).view(rd._out_shape(x.shape, d, False))
    fns = {
        "add": lambda: x.sum(d), "avg": lambda: x.mean(d), "min": lambda: x.amin(d),
        "max": lambda: x.amax(d), "amax": lambda: x.abs().amax(d), "norm1": lambda: x.abs().sum(d),
        "norm2": lambda: torch.linalg.vector_norm(x, 2, d),
    }  # fmt: skip
    return fns[op]()


def _dims(dims):
    return () if dims is None else ((dims % 3,) if isinstance(dims, int) else dims)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_ops_and_dims(op, dtype, poison):
    scale = 0.3 if op in ("mul", "mul_no_zeros") else 2.0
    x = randn(5, 7, 9, dtype=dtype, scale=scale) + (1.0 if op in ("mul", "mul_no_zeros") else 0.0)
    for dims in DIMS:
        y = rd.reduce_tensor(x, op, dims)
        ref = rd.reduce_reference(x, op, _dims(dims))
        assert y.dtype == dtype
        assert_close(y, ref, _torch_same_dtype(x, op, _dims(dims)), f"{op} dims={dims}")


@pytest.mark.parametrize("op", ["min", "max", "amax"])
@pytest.mark.parametrize("dims", [1, (0, 2), None])
def test_indices(op, dims):
    x = randn(4, 33, 6)
    vals, idx = rd.reduce_tensor(x, op, dims, return_indices=True)
    d = _dims(dims) or (0, 1, 2)
    flat = rd._to_matrix_reference(x if op != "amax" else x.abs(), d)
    ref = flat.argmin(1) if op == "min" else flat.argmax(1)
    assert torch.equal(idx.reshape(-1), ref)
    assert torch.equal(vals.reshape(-1), flat.gather(1, ref[:, None]).view(-1))


@pytest.mark.parametrize("op", ["min", "max", "add", "amax"])
def test_nan_and_ties(op):
    x = randn(3, 50)
    x[1, 17] = float("nan")
    x[2, 5] = x[2, 40] = 100.0
    out = rd.reduce_tensor(x, op, 1, return_indices=op in ("min", "max", "amax"))
    vals = out[0] if isinstance(out, tuple) else out
    assert torch.isnan(vals[1])
    if op in ("max", "amax"):
        assert out[1][1] == 17 and out[1][2] == 5  # the NaN, then the first of the tied maxima


@pytest.mark.parametrize("op", ["add", "max", "norm2", "avg", "mul_no_zeros"])
@pytest.mark.parametrize("shape,dims", [((2, 20000), 1), ((20000, 3), 0)], ids=["rows", "columns"])
def test_long_rows_split(op, shape, dims):
    x = randn(*shape) * 0.01 + (1.0 if op == "mul_no_zeros" else 0.0)
    out = rd.reduce_tensor(x, op, dims, return_indices=op == "max")
    y = out[0] if isinstance(out, tuple) else out
    assert_close(y, rd.reduce_reference(x, op, (dims,)), _torch_same_dtype(x, op, (dims,)), op)
    if op == "max":
        assert torch.equal(out[1], x.argmax(dims))
    again = rd.reduce_tensor(x, op, dims, return_indices=op == "max")
    assert torch.equal(y, again[0] if isinstance(again, tuple) else again), "deterministic"


def _chosen(x, op, dims) -> str:
    return next(r.name for r in rd.FAMILY.report(rd._describe(x, op, dims)) if r.chosen)


# Each shape picks a path: one program per row with whole tiles only or a masked last tile, rows
# split over programs, columns split (two column blocks, the second partial). Small enough for the
# interpreter (sm_count() = 4 there), and the same paths on a GPU.
PATHS = [((5, 4096), 1, "tile"), ((5, 5000), 1, "tile"), ((2, 20000), 1, "split"), ((100, 300), 0, "split")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape,dim,engine", PATHS, ids=["whole", "tail", "split-rows", "split-columns"])
def test_paths(shape, dim, engine, dtype, poison):
    x = randn(*shape, dtype=dtype)
    assert _chosen(x, "add", dim) == engine
    for op in ("add", "mul_no_zeros", "norm2", "min", "amax"):
        xin = x * 0.001 + 1.0 if op == "mul_no_zeros" else x
        out = rd.reduce_tensor(xin, op, dim, return_indices=op in ("min", "amax"))
        y = out[0] if isinstance(out, tuple) else out
        assert_close(y, rd.reduce_reference(xin, op, (dim,)), _torch_same_dtype(xin, op, (dim,)), op)
        if op == "min":
            assert torch.equal(out[1], xin.argmin(dim))
        if op == "amax":
            assert torch.equal(out[1], xin.abs().argmax(dim))
    assert torch.equal(rd.reduce_tensor(x, "add", dim), rd.reduce_tensor(x, "add", dim)), "deterministic"


@pytest.mark.parametrize("interleave", [True, False])
def test_split_rows_interleaved_or_in_chunks(interleave, monkeypatch, poison):
    """Both ways of handing a long row's tiles to its splits give the reference's values and
    torch's indices (the heuristic takes interleaved tiles; chunks are a timed candidate)."""
    split = next(e for e in rd.FAMILY.engines if e.name == "split")
    configs = type(split).configs
    monkeypatch.setattr(
        type(split),
        "configs",
        lambda self, p: [c for c in configs(self, p) if c.get("INTERLEAVE", True) == interleave],
    )
    monkeypatch.setattr(rd.FAMILY, "_plans", {})
    monkeypatch.setattr(rd.FAMILY, "_chosen", {})
    x = randn(2, 20000)
    x[1, 15000] = 9.0  # the maximum in a late tile of the second row
    assert _chosen(x, "add", 1) == "split"
    for op in ("add", "norm2"):
        assert_close(rd.reduce_tensor(x, op, 1), rd.reduce_reference(x, op, (1,)), None, op)
    values, indices = rd.reduce_tensor(x, "max", 1, return_indices=True)
    assert torch.equal(values, x.max(1).values) and torch.equal(indices, x.argmax(1))


@pytest.mark.parametrize("shape,columns", [((3, 5000), False), ((3, 20000), False), ((300, 200), True)])
def test_indices_ties_nan_inf_across_tiles(shape, columns):
    """Ties and NaN in later tiles or splits, rows of only -inf/+inf: torch.max/min's indices."""
    dim, k = 1, shape[1]
    # Many exact ties; columns: the reduced dimension is the outer one in memory.
    x = randn(*shape[::-1]).round().t() if columns else randn(*shape).round()
    assert _chosen(x, "max", dim) == ("tile" if k == 5000 else "split")
    x[0, k // 3] = x[0, k - 2] = 50.0  # tied maxima in different tiles/splits
    x[0, k // 2] = -50.0
    x[1, k - 3] = float("nan")  # NaN late, then an earlier one
    x[1, k // 2 + 1] = float("nan")
    x[2] = float("-inf")
    for op, ref in (("max", torch.max), ("min", torch.min)):
        t = x.clone()
        if op == "min":
            t[2] = float("inf")
        vals, idx = rd.reduce_tensor(t, op, dim, return_indices=True)
        ref_vals, ref_idx = ref(t, dim)
        assert torch.equal(idx, ref_idx), op
        assert torch.equal(vals.isnan(), ref_vals.isnan()) and torch.equal(
            vals.nan_to_num(), ref_vals.nan_to_num()
        )
        plain = rd.reduce_tensor(t, op, dim)  # without indices: the NaN-propagating min/max
        assert torch.equal(plain.isnan(), ref_vals.isnan()) and torch.equal(
            plain.nan_to_num(), ref_vals.nan_to_num()
        )


@pytest.mark.parametrize("index_64", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("engine", ["tile", "split"])
def test_engine_paths(engine, columns, index_64):
    """Each engine over rows and columns, with 32- and 64-bit offsets (the latter taken past 2**31
    elements, here forced on a small input). One program per SM: each split gets several tiles
    (rows: a contiguous chunk; columns: every other tile), then the masked last one."""
    x = randn(100, 300).t() if columns else randn(2, 20000)  # columns: the reduced dim is outer
    x[1, 70 if columns else 15000] = float("nan")
    eng = next(e for e in rd.FAMILY.engines if e.name == engine)
    for op in ("max", "add"):
        _, problem = rd._matrix(x, rd.ReduceOp[op.upper()], (1,), op == "max", x.dtype)
        assert rd._columns(problem) == columns
        problem = dataclasses.replace(problem, index_64=index_64)
        config = eng.configs(problem)[0]
        if engine == "split":
            config = {**config, "BLOCK_K": 32 if columns else 1024, "PER_SM": 1}
        out = torch.empty(x.shape[0], device=DEVICE)
        idx = torch.empty(x.shape[0], dtype=torch.int64, device=DEVICE)
        eng.bind(problem, config)(x, out, x, idx, 1.0)
        if op == "max":
            vals, ref = x.max(1)
            assert torch.equal(idx, ref) and torch.equal(out.nan_to_num(), vals.nan_to_num())
        else:
            assert_close(out, x.double().sum(1), x.sum(1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(layout):
    x = LAYOUTS[layout](randn(3, 5, 7, 11))
    for dims in [(1, 3), (0,), None, (2, 3)]:
        d = _dims(dims) if dims is not None else ()
        for op in ("add", "max"):
            out = rd.reduce_tensor(x, op, dims, return_indices=op == "max")
            y = out[0] if isinstance(out, tuple) else out
            assert_close(y, rd.reduce_reference(x, op, d), _torch_same_dtype(x, op, d), f"{op} {dims}")


def test_keepdim_and_scalar():
    x = randn(4, 5, 6)
    assert rd.reduce_tensor(x, "add", (0, 2), keepdim=True).shape == (1, 5, 1)
    v, i = rd.reduce_tensor(x, "min", 1, keepdim=True, return_indices=True)
    assert v.shape == i.shape == (4, 1, 6)
    s = randn(1).reshape(())
    assert_close(rd.reduce_tensor(s, "norm1"), s.double().abs())


@pytest.mark.parametrize("op", OPS)
def test_gradients(op):
    x = randn(4, 6, 5, dtype=torch.float64) + (1.0 if op in ("mul", "mul_no_zeros") else 0.0)
    if op in ("mul", "mul_no_zeros"):
        x[1, 2, 3] = 0.0  # exercises the zero handling of the product's gradient
    xg = x.clone().requires_grad_(True)
    y = rd.reduce_tensor(xg, op, (0, 2))
    dy = randn(*y.shape, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, xg, dy)
    x64 = x.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(rd.reduce_reference(x64, op, (0, 2)), x64, dy)
    assert_close(dx, ref)


def test_empty():
    x = randn(0, 5)
    assert rd.reduce_tensor(x, "add", 0).eq(0).all()
    assert rd.reduce_tensor(x, "mul", 0).eq(1).all()
    assert rd.reduce_tensor(x, "add", 1).shape == (0,)
    with pytest.raises(IndexError):
        rd.reduce_tensor(x, "max", 0)


def test_errors():
    x = randn(3, 4)
    with pytest.raises(ValueError, match="op"):
        rd.reduce_tensor(x, "median")
    with pytest.raises(ValueError, match="out of range"):
        rd.reduce_tensor(x, "add", 2)
    with pytest.raises(ValueError, match="more than once"):
        rd.reduce_tensor(x, "add", (1, -1))
    with pytest.raises(ValueError, match="return_indices"):
        rd.reduce_tensor(x, "add", 1, return_indices=True)
    with pytest.raises(TypeError, match="dtype"):
        rd.reduce_tensor(torch.ones(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="dim"):
        rd.reduce_tensor(x, "add", 1.0)
