"""spekit.allocator: the commands keep freed memory in the process on glibc (large prefill temporaries then reuse the
heap); SPEKIT_KEEP_FREED_MEMORY=0 leaves malloc as it is."""
import platform

import pytest

from spekit.allocator import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_settings_and_the_switch_turns_them_off(monkeypatch):
    assert keep_freed_memory() is True
    monkeypatch.setenv("SPEKIT_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() is False
