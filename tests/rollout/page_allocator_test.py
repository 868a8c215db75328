"""The KV page allocator (`rollout.requests.PageAllocator`): reference counts, and the shards
of an engine whose pool splits over its rows' devices."""

import pytest

from jaxrl.rollout.requests import PageAllocator


def test_page_allocator_refuses_to_free_a_page_nobody_holds_and_frees_nothing_then():
  """A page freed twice would go to two requests at once, each overwriting the other's keys."""
  allocator = PageAllocator(4)
  pages = allocator.allocate(2)
  shared = allocator.share(pages[:1])
  allocator.free(pages)  # the first page is still held by its sharer
  assert allocator.num_free == 3
  with pytest.raises(ValueError, match=f"Page {pages[1]} freed 1 time.*held by 0"):
    allocator.free(pages[1:])
  allocator.free(shared)
  assert allocator.num_free == 4
  (page,) = allocator.allocate(1)
  with pytest.raises(ValueError, match="freed 2 time"):
    allocator.free([page, page])
  assert allocator.num_free == 3  # nothing freed
  with pytest.raises(ValueError, match="Page 7 .*pages 0..3"):
    allocator.free([7])
  allocator.free([page])
  assert allocator.num_free == 4 and sorted(allocator.allocate(4)) == [0, 1, 2, 3]


def test_sharded_allocator_hands_out_each_shards_own_pages():
  allocator = PageAllocator(4, shards=2)
  assert allocator.num_pages == 8 and allocator.num_free == 8
  first, second = allocator.allocate(3, shard=0), allocator.allocate(4, shard=1)
  assert sorted(first) == [0, 1, 2] and sorted(second) == [4, 5, 6, 7]
  assert allocator.allocate(2, shard=0) is None and allocator.free_in(0) == 1  # nothing taken
  assert allocator.allocate(1, shard=1) is None
  allocator.free(allocator.share(second[:1]))  # shared, then dropped: still held once
  allocator.free(second)
  assert allocator.free_in(1) == 4 and allocator.free_in(0) == 1
  assert [allocator.shard_of(p) for p in (0, 3, 4, 7)] == [0, 0, 1, 1]
