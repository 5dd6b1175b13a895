import pytest
import torch

from vptq_core.quant.kmeans import CodebookSearch, _use_kdtree, nearest, weighted_kmeans, weighted_objective


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
    search = CodebookSearch(C)
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
