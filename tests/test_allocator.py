"""spekit.backends.host_memory: the commands keep freed memory in the process on glibc (large prefill temporaries then reuse the
heap); SPEKIT_KEEP_FREED_MEMORY=0 leaves malloc as it is."""
import platform

import pytest

from spekit.backends.host_memory import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_settings_and_the_switch_turns_them_off(monkeypatch):
    assert keep_freed_memory() is True
    monkeypatch.setenv("SPEKIT_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() is False


def test_the_command_line_freezes_what_it_loaded_and_in_process_callers_are_left_alone(monkeypatch):
    """settle() collects and freezes only once the `spekit` command asked for it (SPEKIT_GC_FREEZE=0: never);
    cli.main(argv), as tests and embedding programs call it, does not ask."""
    import gc

    from spekit.backends import host_memory as allocator
    from spekit.commands import main
    monkeypatch.setattr(allocator, "_settle", False)
    assert main(["engine-config", "--engine", "vllm", "--method", "ngram"]) == 0
    assert allocator.settle() is False
    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setenv("SPEKIT_GC_FREEZE", "0")
    allocator.freeze_after_loading()
    assert allocator.settle() is False and not frozen
    monkeypatch.delenv("SPEKIT_GC_FREEZE")
    allocator.freeze_after_loading()
    assert allocator.settle() is True and frozen == [True]
