"""Bad ``loraplex serve`` settings (flags and ``LORAPLEX_*`` variables) are refused by name before any work.

A value outside a flag's choices stops argparse (exit 2, the flag named); the same value from the environment
raises ``ConfigError`` naming the setting, which ``main`` reports on stderr with exit status 2. Rows of
docs/bad-inputs.md's second table name these tests.
"""

from __future__ import annotations

import pytest

from service.cli import OPENMP_DEFAULTS, build_parser, main, serve_settings
from service.config import ConfigError

BAD_CHOICES = [
    ("--dtype", "float8"),
    ("--quantize", "int3"),
    ("--weights", "fastest"),
    ("--kernels", "fast"),
    ("--log-format", "xml"),
    ("--log-level", "LOUD"),
]
BAD_VALUES = [
    ("DTYPE", "float8", "dtype must be one of"),
    ("QUANTIZE", "int3", "quantize must be one of"),
    ("WEIGHTS", "fastest", "weights must be one of"),
    ("KERNELS", "fast", "kernels must be one of"),
    ("QUANTIZE_GROUP_SIZE", "16", "quantize_group_size must be 32, 64 or 128"),
    ("PREFILL_CHUNK_TOKENS", "-1", "prefill_chunk_tokens must be >= 0"),
    ("ADAPTER_OVERFLOW_ADAPTERS", "-1", "adapter_overflow_adapters must be >= 0"),
    ("DENSE_COPIES_MB", "-2", "dense_copies_mb must be -1"),
    ("DENSE_COPIES_MB", "64", "dense_copies_mb applies to a quantized base"),
    ("DRAFT", "medusa", "draft must be none or one of"),
    ("DRAFT_NGRAM", "17", "draft_ngram must be at most 16"),
    ("DRAFT_TOKENS", "0", "draft_ngram and draft_tokens must be >= 1"),
    ("DRAFT_TOKENS", "33", "draft_tokens must be at most 32"),
    ("MAX_CONSTRAINT_BYTES", "0", "max_constraint_bytes must be > 0"),
    ("MAX_CONSTRAINT_CHOICES", "-1", "max_constraint_choices must be > 0"),
    ("MAX_CONSTRAINT_DEPTH", "0", "max_constraint_depth must be > 0"),
    ("MAX_CONSTRAINT_COMPILE_SECONDS", "0", "max_constraint_compile_seconds must be > 0"),
    ("CONSTRAINT_CACHE_BYTES", "-1", "constraint_cache_bytes must be >= 0"),
    ("MAX_MIXTURE_ADAPTERS", "0", r"max_mixture_adapters must be in \[1, 16\]"),
    ("MAX_MIXTURE_ADAPTERS", "17", r"max_mixture_adapters must be in \[1, 16\], got 17"),
    ("MAX_SAVED_MODULE_BYTES", "-1", "max_saved_module_bytes must be >= 0"),
    ("LOG_FORMAT", "xml", "log_format must be one of"),
    ("LOG_LEVEL", "LOUD", "log_level one of"),
]


@pytest.mark.parametrize(("flag", "value"), BAD_CHOICES, ids=[flag for flag, _ in BAD_CHOICES])
def test_a_flag_value_outside_its_choices_stops_serve_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: '{value}'" in err, err


@pytest.mark.parametrize(("name", "value", "fragment"), BAD_VALUES, ids=[name for name, _, _ in BAD_VALUES])
def test_a_bad_setting_value_is_a_config_error_naming_it(name: str, value: str, fragment: str) -> None:
    args = build_parser().parse_args(["serve"])
    with pytest.raises(ConfigError, match=fragment):
        serve_settings(args, {f"LORAPLEX_{name}": value})


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--prefill-chunk-tokens", "-1"),
        ("--quantize-group-size", "16"),
        ("--dense-copies-mb", "-2"),
        ("--adapter-overflow-adapters", "-1"),
    ],
)
def test_serve_with_a_bad_number_exits_2_before_loading(
    flag: str, value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in (
        "LORAPLEX_PREFILL_CHUNK_TOKENS",
        "LORAPLEX_QUANTIZE_GROUP_SIZE",
        "LORAPLEX_DENSE_COPIES_MB",
        "LORAPLEX_ADAPTER_OVERFLOW_ADAPTERS",
        *OPENMP_DEFAULTS,
    ):
        monkeypatch.delenv(var, raising=False)  # serve sets its OpenMP defaults in os.environ: undone after
    assert main(["serve", flag, value, "--model", "no-such-model-folder"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex serve: ") and flag.lstrip("-").replace("-", "_") in err, err
