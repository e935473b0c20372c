"""diagnose: the knowledge base (data, one sample log per rule), root-cause order, unknown logs."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml
from ops_helpers import DATA

from qwenserve.entrypoints.cli import main
from qwenserve.tools import diagnose
from qwenserve.tools.diagnose import diagnose_text, load_rules, parse_rules

SAMPLES = DATA / "diagnose"
CASES = DATA / "diagnose_cases"
RULE_IDS = [rule.id for rule in load_rules()]
RULES_PATH = Path(diagnose.__file__).with_name(diagnose.RULES_FILE)


def test_knowledge_base_is_data_with_at_least_25_rules():
    entries = yaml.safe_load(RULES_PATH.read_text())
    assert len(entries) >= 25 and len(load_rules()) == len(entries)
    for entry in entries:
        assert {"id", "title", "patterns", "explanation", "fix"} <= set(entry), entry.get("id")
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", entry["id"])
        assert re.search(
            r"--[a-z]|[A-Z_]{4,}=|\b(export|source|pip|kill|ss|npu-smi|huggingface-cli|"
            r"docker|chmod|cd|Put|Use|Send|Check|Find|Read|Install|Start|Fix|Delete|"
            r"Accept|Download|Serve|Truncate|Upgrade)\b",
            entry["fix"],
        ), entry["id"]


def test_superseded_rules_exist():
    for rule in load_rules():
        assert set(rule.supersedes) <= set(RULE_IDS), rule.id


def test_qwenserves_wrapper_of_an_oom_replaces_the_oom():
    verdict = diagnose_text((SAMPLES / "qs-weights-do-not-fit.log").read_text())
    assert verdict.rule.id == "qs-weights-do-not-fit" and ("oom-loading-weights", 5) in verdict.also


def test_placeholders_are_defined_by_every_pattern_of_their_rule():
    for rule in load_rules():
        used = set(re.findall(r"\$\{(\w+)\}", rule.explanation + rule.fix))
        for pattern in rule.patterns:
            assert used <= set(pattern.groupindex), (rule.id, pattern.pattern)


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_each_rule_names_its_sample_log(rule_id):
    verdict = diagnose_text((SAMPLES / f"{rule_id}.log").read_text())
    assert verdict.rule is not None and verdict.rule.id == rule_id
    assert "${" not in verdict.explanation + verdict.fix


def test_every_sample_log_belongs_to_a_rule():
    assert {p.stem for p in SAMPLES.glob("*.log")} == set(RULE_IDS)


def test_the_first_root_cause_wins_over_its_consequences():
    verdict = diagnose_text((CASES / "oom-then-consequences.log").read_text())
    assert verdict.rule.id == "oom-loading-weights" and verdict.line == 9
    assert "NPU out of memory" in verdict.excerpt
    assert [rule_id for rule_id, _ in verdict.also] == [
        "collective-timeout",
        "engine-core-init-failed",
    ]


def test_order_in_the_log_decides_not_the_order_of_the_rules():
    verdict = diagnose_text((CASES / "hccl-then-oom.log").read_text())
    assert verdict.rule.id == "hccl-init-failed" and verdict.line == 1
    assert ("oom-runtime", 2) in verdict.also


def test_a_fallback_symptom_yields_to_a_later_real_cause():
    log = (SAMPLES / "engine-core-init-failed.log").read_text() + (
        SAMPLES / "port-in-use.log"
    ).read_text()
    assert diagnose_text(log).rule.id == "port-in-use"


def test_values_from_the_log_fill_the_fix():
    verdict = diagnose_text((SAMPLES / "max-seq-len-exceeds-kv-cache.log").read_text())
    assert "--max-model-len 3664" in verdict.fix and "max_model_len=4096" in verdict.explanation


def test_v1_wording_with_ansi_colors():
    verdict = diagnose_text((CASES / "colored-v1-kv.log").read_text())
    assert verdict.rule.id == "max-seq-len-exceeds-kv-cache"
    assert "--max-model-len 20480" in verdict.fix and "\x1b" not in verdict.excerpt


def test_qwenserve_kv_message_gives_the_token_count():
    verdict = diagnose_text((SAMPLES / "qs-kv-cache-too-small.log").read_text())
    assert "Lower --max-model-len to 17536" in verdict.fix


def test_unknown_log_gives_the_last_exception_and_points_at_doctor():
    verdict = diagnose_text((CASES / "unknown.log").read_text())
    assert verdict.rule is None
    assert (
        verdict.last_exception
        == "mycompany_plugin.errors.PluginRegistryError: plugin registry is empty"
    )
    assert "qwenserve doctor" in verdict.fix


def test_cli_text_output_and_exit_codes(capsys):
    assert main(["diagnose", str(SAMPLES / "libascend-hal-missing.log")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Root cause: The Ascend driver library libascend_hal.so is not found")
    assert (
        "libascend-hal-missing.log:9: ImportError: libascend_hal.so" in out and "Fix: Mount" in out
    )
    assert main(["diagnose", str(CASES / "unknown.log")]) == 1
    out = capsys.readouterr().out
    assert (
        "Last exception: mycompany_plugin.errors.PluginRegistryError" in out
        and "qwenserve doctor" in out
    )


def test_cli_json(capsys):
    assert main(["diagnose", "--json", str(SAMPLES / "port-in-use.log")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matched"] is True and report["id"] == "port-in-use" and report["line"] == 4
    assert set(report) == {
        "source",
        "matched",
        "id",
        "title",
        "line",
        "excerpt",
        "explanation",
        "fix",
        "also_matched",
        "last_exception",
    }


@pytest.mark.parametrize("argv", [["diagnose", "-"], ["diagnose"]])
def test_dash_or_nothing_reads_stdin(capsys, monkeypatch, argv):
    monkeypatch.setattr("sys.stdin", io.StringIO((SAMPLES / "tp-not-divisible.log").read_text()))
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "<stdin>" and report["id"] == "tp-not-divisible"
    assert "divides 32" in report["fix"]


def test_unreadable_log_exits_2(capsys, tmp_path):
    assert main(["diagnose", str(tmp_path / "missing.log")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_only_the_tail_of_a_huge_log_is_read(capsys, tmp_path):
    path = tmp_path / "big.log"
    path.write_text(
        "RuntimeError: NPU out of memory.\n"
        + "INFO filler line\n" * 2000
        + (SAMPLES / "port-in-use.log").read_text()
    )
    assert main(["diagnose", "--json", "--max-bytes", "4096", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == "port-in-use"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"id": "x", "title": "t", "patterns": ["a"], "explanation": "e"}], "lacks fix"),
        (
            [{"id": "x", "title": "t", "patterns": ["(unclosed"], "explanation": "e", "fix": "f"}],
            "bad regex",
        ),
        (
            [{"id": "x", "title": "t", "patterns": "a", "explanation": "e", "fix": "f"}],
            "list of strings",
        ),
        (
            [{"id": "x", "title": "t", "patterns": ["a"], "explanation": "e", "fix": "f"}] * 2,
            "duplicate",
        ),
        ({"id": "x"}, "must be a list"),
    ],
)
def test_malformed_rules_fail_loudly(entries, message):
    with pytest.raises(ValueError, match=message):
        parse_rules(entries)


@pytest.mark.parametrize(("fragment", "rule_id"), [
    ("You passed 5000 input tokens and requested 100 output tokens. However, the model's context "
     "length is only 4096 tokens, resulting in a maximum input length of 3996 tokens.",
     "qs-context-length-exceeded"),
    ("hcclCommInitRootInfoConfig(numRanks, &rootInfo, rank, config, &(comm->hcclComm_)), error "
     "code is 11", "hccl-init-failed"),
    ("aclrtSetDevice failed, error code 507033", "invalid-device-id"),
    ("RuntimeError: The server socket has failed to listen on any local network address. port: "
     "29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
     "port-in-use"),
    ("INFO No platform detected, vLLM is running on UnspecifiedPlatform", "torch-npu-missing"),
    ("TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser",
     "tool-call-parser-missing"),
    ("RuntimeError: Worker failed with error 'exitcode 9', please check the stack trace above",
     "host-oom-killed"),
])  # fmt: skip
def test_variants_of_the_common_errors(fragment, rule_id):
    """Other wordings of the research's error table (section 6) than the sample logs use."""
    assert diagnose_text(fragment).rule.id == rule_id
