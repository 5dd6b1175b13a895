import pytest
import torch

from vptq_core.kernels import native
from vptq_core.quant.kmeans import (
    CodebookSearch,
    _native_wins,
    _use_kdtree,
    nearest,
    weighted_kmeans,
    weighted_objective,
)


def test_nearest_matches_brute_force_both_paths():
    gen = torch.Generator().manual_seed(1)
    X, C = torch.randn(3000, 6, generator=gen), torch.randn(64, 6, generator=gen)
    brute = torch.cdist(X, C).argmin(dim=1)
    assert torch.equal(nearest(X, C), brute)  # compiled path (n*k >= 65536)
    assert torch.equal(nearest(X[:100], C), brute[:100])  # torch path


@pytest.mark.parametrize("d,k", [(6, 4096), (4, 256), (8, 1024)])
def test_kdtree_path_is_exact(d, k):
    assert _use_kdtree(d, k)
    gen = torch.Generator().manual_seed(d + k)
    X, C = torch.randn(2000, d, generator=gen), torch.randn(k, d, generator=gen)
    search = CodebookSearch(C, backend="kdtree")
    assert search._tree is not None
    idx = search(X)
    brute = torch.cdist(X.double(), C.double()).argmin(dim=1)
    assert torch.equal(idx, brute)
    # the same search object answers repeated queries (the sweep asks once per column)
    assert torch.equal(search(X[:96]), brute[:96])


def test_weighted_kmeans_lowers_weighted_objective():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(4000, 4, generator=gen)
    w = torch.rand(4000, generator=gen) * 10
    res = weighted_kmeans(X, w, k=32, iters=8, seed=0)
    assert res.objective[-1] < 0.8 * res.objective[0]
    assert all(b <= a + 1e-6 for a, b in zip(res.objective, res.objective[1:]))
    final = weighted_objective(X, w, res.centroids, nearest(X, res.centroids))
    assert res.objective[-1] == pytest.approx(final, rel=1e-5)


def test_weights_pull_centroids():
    # Two clusters; with one centroid the weighted mean follows the heavy cluster.
    X = torch.cat([torch.zeros(50, 2), torch.ones(50, 2) * 10])
    w = torch.cat([torch.full((50,), 9.0), torch.full((50,), 1.0)])
    res = weighted_kmeans(X, w, k=1, iters=3)
    torch.testing.assert_close(res.centroids, torch.tensor([[1.0, 1.0]]))


def test_seeded_and_fewer_points_than_centroids():
    X = torch.randn(10, 3, generator=torch.Generator().manual_seed(2))
    a = weighted_kmeans(X, None, k=16, iters=3, seed=5)
    b = weighted_kmeans(X, None, k=16, iters=3, seed=5)
    assert torch.equal(a.centroids, b.centroids)
    assert torch.equal(a.centroids[:10], X)  # every point is its own centroid


def test_bad_input():
    with pytest.raises(ValueError, match=r"X must be \[n, d\]"):
        weighted_kmeans(torch.randn(5), None, 2, 1)
    with pytest.raises(ValueError, match=r"weights must have shape \(5,\)"):
        weighted_kmeans(torch.randn(5, 2), torch.ones(4), 2, 1)


# ------------------------------------------------------------------------------------------ the native search
needs_native = pytest.mark.skipif(not native.status()[0], reason="native kernels unavailable")


@needs_native
@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
@pytest.mark.parametrize("d,k,n", [(1, 5, 7), (2, 4096, 301), (3, 257, 64), (4, 4096, 1000), (6, 4096, 258),
                                   (8, 256, 33), (12, 1000, 130), (16, 64, 9)])
def test_native_search_is_exact(isa, d, k, n):
    """Every vector length 1-16 the kernel unrolls for (here a sample), k not a multiple of 8 (padded centroids must
    never win), query counts not a multiple of the 4-query block: the nearest centroid, as float64 brute force
    finds it, or one at the same distance to float32 rounding."""
    if isa != "auto" and native.set_isa(isa) != isa:
        pytest.skip(f"this CPU cannot run {isa}")
    try:
        gen = torch.Generator().manual_seed(d * 1000 + k)
        X, C = torch.randn(n, d, generator=gen), torch.randn(k, d, generator=gen)
        search = CodebookSearch(C, backend="native")
        assert search.backend == "native"
        idx = search(X)
        assert idx.dtype == torch.long and idx.shape == (n,) and int(idx.max()) < k
        exact = torch.cdist(X.double(), C.double())
        chosen = exact.gather(1, idx.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(chosen, exact.min(dim=1).values, rtol=1e-5, atol=1e-6)
        assert (idx == exact.argmin(dim=1)).float().mean() >= 0.995
    finally:
        native.set_isa("auto")


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_native_search_breaks_ties_to_the_lowest_index(threads):
    """Duplicated centroids (exactly equal distances) resolve to the first copy, as torch.argmin does, whichever
    lane or thread holds them."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(37, 6, generator=gen)
    C = torch.cat([base, base, base[:5]])  # centroid i, i + 37 (and i + 74 for i < 5) are identical
    X = base[torch.randint(0, 37, (203,), generator=gen)] + 1e-3 * torch.randn(203, 6, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        idx = CodebookSearch(C, backend="native")(X)
    finally:
        torch.set_num_threads(before)
    exact = torch.cdist(X.double(), C.double(), compute_mode="donot_use_mm_for_euclid_dist")
    assert torch.equal(idx, exact.argmin(dim=1))
    assert int(idx.max()) < 37


@needs_native
def test_auto_search_takes_native_where_it_wins_and_the_tree_elsewhere():
    assert CodebookSearch(torch.randn(4096, 6)).backend == "native"
    assert CodebookSearch(torch.randn(64, 8)).backend == "native"
    assert not _native_wins(4, 16384) and CodebookSearch(torch.randn(16384, 4)).backend == "kdtree"
    assert CodebookSearch(torch.randn(64, 17)).backend == "numba"  # longer than the kernel's 16 lanes


def test_native_search_falls_back_without_the_native_kernels(monkeypatch):
    monkeypatch.setenv("VPTQ_NATIVE", "0")
    C = torch.randn(4096, 6)
    assert CodebookSearch(C).backend == "kdtree"
    with pytest.raises(RuntimeError, match="native search is unavailable: native kernels disabled by VPTQ_NATIVE=0"):
        CodebookSearch(C, backend="native")


@needs_native
def test_native_search_refuses_bad_tensors():
    ext = native._ext()
    CT, csq = torch.zeros(6, 16), torch.zeros(16)
    with pytest.raises(RuntimeError, match="X must be a 2-D float32 CPU tensor"):
        ext.nearest(torch.zeros(4, 6, dtype=torch.float64), CT, csq)
    with pytest.raises(RuntimeError, match="kp a multiple of 8"):
        ext.nearest(torch.zeros(4, 6), torch.zeros(6, 12), torch.zeros(12))
    with pytest.raises(RuntimeError, match="vector length d must be 1..16"):
        ext.nearest(torch.zeros(4, 17), torch.zeros(17, 16), csq)
    with pytest.raises(RuntimeError, match=r"csq must be a contiguous float32 \[16\] tensor"):
        ext.nearest(torch.zeros(4, 6), CT, torch.zeros(8))
