"""The speed bench's test sizes and its handling of a measurement process that dies (bench/speed.py)."""
import sys

import pytest

from bench import speed


def test_a_measurement_killed_by_sigill_names_the_no_amx_build():
    """A native llama.cpp build dies with SIGILL where the CPU reports AMX and refuses it: the error says so."""
    command = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    with pytest.raises(RuntimeError, match="SIGILL.*--llama-no-amx"):
        speed.run_child(command, {})


def test_prefill_and_decode_sizes_override_the_defaults_and_quick():
    assert speed.measured_sizes(False, None, None) == (512, 128)
    assert speed.measured_sizes(True, None, None) == (128, 32)
    assert speed.measured_sizes(True, 4096, None) == (4096, 32)
    assert speed.measured_sizes(False, None, 16) == (512, 16)
