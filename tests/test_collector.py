"""The collector pause around planning leaves the interpreter's collector as it found it."""
import gc
import weakref

from autopar.collector import settle, young_objects_only


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_old_objects_are_set_aside_and_returned() -> None:
    gc.unfreeze()  # a library imported earlier in this process may have frozen its own objects
    old = _Cycle()
    old_ref = weakref.ref(old)
    with young_objects_only():
        assert gc.get_freeze_count() > 0
        del old
        young = _Cycle()
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None  # cycles made in the block are collected
        assert old_ref() is not None  # older ones are not scanned
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # and are collected after it


def test_a_freeze_made_outside_is_kept() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with young_objects_only():
            _Cycle()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_collector_disabled_stays_disabled() -> None:
    gc.disable()
    try:
        with young_objects_only():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_stages_objects_are_settled_within_the_block_and_returned_after_it() -> None:
    gc.unfreeze()
    with young_objects_only():
        kept = _Cycle()  # what a stage makes for the stages after it
        kept_ref = weakref.ref(kept)
        before = gc.get_freeze_count()
        settle()
        assert gc.get_freeze_count() > before
        del kept
        gc.collect()
        assert kept_ref() is not None  # set aside: not scanned again within the block
        later = _Cycle()
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None  # what is made after it is collected as before
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert kept_ref() is None


def test_settle_outside_the_block_sets_nothing_aside() -> None:
    gc.unfreeze()
    settle()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # someone else's freeze: the block leaves it, and settles nothing of its own
    try:
        frozen = gc.get_freeze_count()
        with young_objects_only():
            _Cycle()
            settle()
            assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
