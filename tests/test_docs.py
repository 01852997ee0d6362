"""The README and docs/ stay true: every relative link and quoted repository path resolves, every command they
quote for pretrain_gpt.py, a tool or a benchmark names flags that exist, and every section of the former long
README has a page that holds its figures."""

from __future__ import annotations

import functools
import glob
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    from megatron_lite.config.arguments import build_parser
except ImportError:
    from megatron_lite.config.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# Markdown files outside docs/ that the pages link to with anchors.
OTHER_MARKDOWN = [ROOT / "data" / "README.md", ROOT / "checkpoints" / "README.md"]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"^(?:\./)?((?:tools|examples/slurm)/[\w-]+\.py|pretrain_gpt\.py|benchmarks/[\w-]+\.py)$")
FLAG = re.compile(r"--[a-z0-9][a-z0-9_-]*")  # underscores: lm-eval's flags (tools/run_lm_eval.py)
REPO_PATH = re.compile(r"^[\w.*-]+(?:/[\w.*-]+)+\.(?:py|md|sh|yaml|sbatch|jsonl|json|png)$")


def _read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@functools.cache
def _anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(_read(page)).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


def _links(page: Path) -> list[str]:
    return [target for target in LINK.findall(INLINE_CODE.sub("", _prose(_read(page))))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def test_the_pages_exist():
    names = {page.name for page in DOCS.glob("*.md")}
    assert {"training.md", "parallelism.md", "moe.md", "architectures.md", "precision.md", "optimizers.md",
            "data.md", "checkpoints.md", "huggingface.md", "planner.md", "logging.md", "reliability.md",
            "multinode.md", "gpu.md", "benchmarks.md", "design.md", "flags.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _quoted_paths(page: Path) -> set[str]:
    spans = INLINE_CODE.findall(_prose(_read(page)).replace("\n", " "))
    return {span for span in spans if REPO_PATH.match(span)}


def _resolves(path: str) -> bool:
    """A quoted path names a file from the repository root, or a module from megatron_lite/ (design.md writes
    `model/gpt.py`); a path with * names at least one file."""
    return any(glob.glob(str(base / path)) for base in (ROOT, ROOT / "megatron_lite"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_repository_path_exists(page):
    missing = sorted(path for path in _quoted_paths(page) if not _resolves(path))
    assert not missing, f"{page.relative_to(ROOT)} quotes files that do not exist: {missing}"


# Quoted commands


@dataclass
class Command:
    page: str
    text: str
    script: str  # pretrain_gpt.py, tools/X.py, examples/slurm/X.py, or benchmarks/X.py
    args: list[str] = field(default_factory=list)
    placeholders: bool = False  # `...` or an unresolved $VARIABLE: only the flag names can be checked

    @property
    def flags(self) -> list[str]:
        return [arg.split("=", 1)[0] for arg in self.args if arg.startswith("--")]


def _command_lines(block: str) -> list[str]:
    """The commands of a code block, continuation lines joined: the `$ ` lines of a transcript, else every line."""
    lines = block.splitlines()
    transcript = any(line.startswith("$ ") for line in lines)
    commands, current, continuing = [], "", False
    for line in lines:
        if continuing:
            current += " " + line.strip()
        elif transcript and line.startswith("$ "):
            current = line[2:].strip()
        elif not transcript and line.strip() and not line.lstrip().startswith("#"):
            current = line.strip()
        else:
            continue
        continuing = current.endswith("\\")
        if continuing:
            current = current[:-1].rstrip()
        else:
            commands.append(current)
    return commands


def _parse(page: str, text: str) -> Command | None:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    for segment in _segments(tokens):
        for i, token in enumerate(segment):
            if token == "-m" and i + 1 < len(segment) and segment[i + 1].startswith("benchmarks."):
                script, args = segment[i + 1].replace(".", "/") + ".py", segment[i + 2:]
            elif SCRIPT.match(token):
                script, args = SCRIPT.match(token).group(1), segment[i + 1:]
            else:
                continue
            placeholders = any(arg == "..." or "$" in arg for arg in args)
            return Command(page, text, script, [a for a in args if a != "..."], placeholders)
    return None


def _segments(tokens: list[str]) -> list[list[str]]:
    segments, current = [], []
    for token in tokens:
        if token in ("|", "&&", "||", ";"):
            segments.append(current)
            current = []
        else:
            current.append(token)
    return [*segments, current]


@functools.cache
def _quoted_commands() -> tuple[Command, ...]:
    commands = []
    for page in PAGES:
        text = _read(page)
        name = str(page.relative_to(ROOT))
        candidates = [line for block in FENCE.findall(text) for line in _command_lines(block)]
        candidates += [span for span in INLINE_CODE.findall(_prose(text).replace("\n", " "))
                       if re.match(r"^(python|torchrun|srun|pretrain_gpt\.py|tools/)\S* ", span)]
        for candidate in candidates:
            command = _parse(name, candidate)
            if command is not None:
                commands.append(command)
    return tuple(commands)


@functools.cache
def _pretrain_flags() -> frozenset[str]:
    return frozenset(s for action in build_parser()._actions for s in action.option_strings)


@functools.cache
def _script_flags(script: str) -> frozenset[str]:
    """The flags a script accepts: for tools and examples, what its --help prints (plus pretrain_gpt.py's where
    the help says it takes those too); for benchmarks, the flags its source declares (importing one loads torch)."""
    path = ROOT / script
    assert path.exists(), f"{script} does not exist"
    if script.startswith("benchmarks/"):
        return frozenset(re.findall(r"[\"'](--[a-z0-9][a-z0-9-]*)[\"']", path.read_text(encoding="utf-8")))
    done = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{script} --help exited {done.returncode}: {done.stderr[-2000:]}"
    flags = set(FLAG.findall(done.stdout))
    if "pretrain_gpt.py's" in done.stdout:
        flags |= _pretrain_flags()
    return frozenset(flags)


def checked_and_skipped() -> tuple[list[Command], list[Command]]:
    """Commands that are checked (the script exists and every flag is one it takes), and those with nothing to
    check (`torchrun pretrain_gpt.py ...`: no flag besides placeholders)."""
    commands = _quoted_commands()
    skipped = [c for c in commands if c.placeholders and not c.flags]
    return [c for c in commands if c not in skipped], skipped


def test_the_docs_quote_many_commands():
    checked, skipped = checked_and_skipped()
    by_kind = {kind: sum(c.script.startswith(kind) for c in checked) for kind in ("pretrain", "tools", "benchmarks")}
    whole = sum(not c.placeholders for c in checked)
    print(f"\nquoted commands: {len(checked)} checked ({whole} without placeholders, "
          f"{sum(bool(c.flags) for c in checked)} with flags), {len(skipped)} skipped (only placeholders); {by_kind}")
    assert len(checked) >= 40 and len(checked) >= 10 * len(skipped)
    assert min(by_kind.values()) >= 5, by_kind


@pytest.mark.parametrize("command", checked_and_skipped()[0], ids=lambda c: f"{c.page}:{c.script}:{c.text[:60]}")
def test_every_quoted_flag_exists(command):
    assert (ROOT / command.script).exists(), f"{command.page}: {command.script} does not exist ({command.text})"
    if not command.flags:
        return
    known = _pretrain_flags() if command.script == "pretrain_gpt.py" else _script_flags(command.script)
    unknown = [flag for flag in command.flags if flag not in known]
    assert not unknown, f"{command.page}: {command.script} has no {unknown} (in: {command.text})"


@pytest.mark.parametrize("command", [c for c in checked_and_skipped()[0]
                                     if c.script == "pretrain_gpt.py" and not c.placeholders
                                     and not {"-h", "--help"} & set(c.args)],
                         ids=lambda c: f"{c.page}:{c.text[:60]}")
def test_every_whole_pretrain_command_parses(command):
    """Values too: counts are numbers, choices are among the choices, lists have their lengths."""
    try:
        build_parser().parse_args(command.args)
    except SystemExit as exit_:
        pytest.fail(f"{command.page}: the parser refuses (exit {exit_.code}): {command.text}")


# The README as the front door


def test_the_readme_is_one_screen_of_features():
    text = _read(ROOT / "README.md")
    assert len(text.splitlines()) <= 200
    features = text.split("## Features", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in features.splitlines() if line.startswith("|") and not line.startswith("|---")]
    assert len(rows) >= 20
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 3 and all(len(cell) <= 120 for cell in cells), row


def test_the_readme_keeps_the_two_commands():
    text = _read(ROOT / "README.md")
    assert "bash examples/demo_cpu.sh      # main job" in text
    assert "bash scripts/run_tests.sh      # the test suite" in text


# Where each section of the former README went, with figures its page must still hold.

REVIEW_MAP = [
    # (former section or feature row, page, figures and terms the page keeps)
    ("The two commands", "README.md", ["bash examples/demo_cpu.sh", "VENV=.venv-torch2.11 TORCH=2.11.0",
                                       "dcp.save(no_dist=...)"]),
    ("The two commands: the demo's output", "training.md", ["lm loss 6.294815", "tokens/s 2,317",
                                                            "ROMEO. O, she doth teach the torches to burn bright!",
                                                            "rm -rf checkpoints/demo"]),
    ("Features: GPT-2 and Llama", "architectures.md", ["1e-5", "RMSNorm, SwiGLU, RoPE, GQA"]),
    ("Features: data parallel", "parallelism.md", ["DP2 equals one process", "--overlap-grad-reduce"]),
    ("Features: Megatron-compatible data", "data.md", [".bin/.idx", "Megatron-Core's"]),
    ("Features: training straight from raw text", "data.md", ["DP 2->4, 2->1, 4->2", "--skip-bad-records N",
                                                              "46,494", "0.69-0.99", "165-184k"]),
    ("Features: tensor + sequence parallel", "parallelism.md", ["2 all-reduces per layer", "TP2/4"]),
    ("Features: pipeline parallel", "parallelism.md", ["0.135", "0.42", "0.39", "[4, 3, 2, 1]", "[11, 9, 7, 5]",
                                                       "MEGATRON_LITE_PP_TRACE=1"]),
    ("Features: distributed optimizer", "parallelism.md", ["18", "4.5", "--num-distributed-optimizer-instances",
                                                           "resumes at N=1 and N=4"]),
    ("Features: optimizer CPU offload", "optimizers.md", ["10.16 MiB", "5.08 MiB", "6.00 MiB",
                                                          "--optimizer-offload-fraction"]),
    ("Features: Muon", "optimizers.md", ["4.481", "4.485", "4.603", "4.739", "4.818", "4.887", "4.901", "5.319",
                                         "27%", "0.42 s", "0.33 s", "8e-6", "3.4445, -4.7750, 2.0315",
                                         "2026-12-02"]),
    ("Features: sharded checkpoints", "checkpoints.md", ["TP2xPP2xDP2", "TP1xPP4xDP2", "--async-save"]),
    ("Features: context parallel", "parallelism.md", ["CP2/4", "2cp-1-i", "a2a"]),
    ("Features: documents in a packed sequence", "architectures.md", ["--reset-attention-mask", "FlexAttention",
                                                                      "one kernel call per document"]),
    ("Features: mixture of experts", "moe.md", ["--moe-router-enable-expert-bias", "torch._grouped_mm",
                                                "TP2xPP2 at ETP1xEP2", "TP1xDP4 at ETP2xEP2", "ETP1xEP4",
                                                "([0]*3+[1]*58)"]),
    ("Features: DeepSeek-V3 architecture", "architectures.md", ["671,026,419,200", "37.6B", "15.29B", "2.24B",
                                                                "--kv-lora-rank", "--yarn-beta-fast"]),
    ("Features: multi-token prediction", "architectures.md", ["1.4%", "0.1-1.9%", "enorm", "eh_proj",
                                                              "mtp_<k>_loss", "llama_fp32_untied_mtp2"]),
    ("Features: Hugging Face conversion", "huggingface.md", ["qwen2_moe", "deepseek_v3", "EP2xTP2",
                                                             "tensor-identical"]),
    ("Features: logging", "logging.md", ["wandb_run_id.txt", "tools/plot_metrics.py", "MFU"]),
    ("Features: activation recomputation", "training.md", ["--recompute-granularity", "selective"]),
    ("Features: FP8 training", "precision.md", ["+0.39%", "-0.94%", "+0.32%", "-0.53%", "torch._scaled_grouped_mm",
                                                "delayed", "mxfp8", "python -m benchmarks.fp8"]),
    ("Features: --torch-compile", "gpu.md", ["1.02-1.04x", "torch 2.13 and 2.11", "One graph serves"]),
    ("Features: a lean training step", "gpu.md", ["2.5 fp32 logits", "4.0", "_foreach_norm", "pinned memory"]),
    ("Features: attention kernels", "architectures.md", ["--attention-backend flash", "sdpa_kernel_name"]),
    ("Usage", "training.md", ["--rampup-batch-size 32 32 2000000", "--lr-wsd-decay-samples 2000000",
                              "examples/llama3.2_1b_recipe.yaml", "1 - sqrt", "--lr-warmup-init",
                              "--calculate-per-token-loss", "0.13", "gpt2-124m"]),
    ("Usage: a bad configuration", "reliability.md", ["must be divisible by num-query-groups (3)"]),
    ("Training straight from raw text", "data.md", ["--raw-text-chunk-mib", "10.64 GFLOP", "989 TFLOP/s",
                                                    'pip install -e ".[zstd]"']),
    ("Following a run", "logging.md", ["--log-timers-to-tensorboard", "WANDB_RUN_ID", "--profile-step-start 10",
                                       "ui.perfetto.dev", "valid_lm_loss"]),
    ("Hugging Face checkpoints", "huggingface.md", ["hf/TinyLlama-1.1B", "--max-shard-size 5GB",
                                                    "--rope-scaling-low-freq-factor", "rope_interleave",
                                                    "1,235,814,400", "8.31 s", "10.45 s"]),
    ("Multi-node", "multinode.md", ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "pytorch/pytorch#135712",
                                    "join_timeout", "RendezvousTimeoutError", "[0,8] [1,9] [2,10]",
                                    "--gpus-per-task", "the launcher (pid P) is gone"]),
    ("Planning a layout", "planner.md", ["90,360", "37 s", "7%", "2.2%", "870 valid layouts", "6405 valid layouts",
                                         "210,821,267,456", "11.89 GiB across nodes", "1.06 GiB across nodes"]),
    ("What happens when things go wrong", "reliability.md", ["status 17", "CRC-32", "run.lock",
                                                             "30 consecutive 2-rank runs", "curves.jpgx",
                                                             "rerun_max_relative_difference",
                                                             "--distributed-timeout-minutes", "weights_only=True"]),
    ("Design", "design.md", ["counter-based normal draw", "Box-Muller", "0.1.0", "ModelChunk",
                             "tests/harness.py", "megatron_lite/", "generation.py"]),
    ("Design: pipeline schedules", "parallelism.md", ["forward_step_func(data_iterator, model)", "Qi et al. 2023",
                                                      "gloo's batched p2p can hang"]),
    ("Design: FP8 through torch._scaled_mm", "precision.md", ["torchao", "amax_over_groups", "e5m2"]),
    ("Adding a model family", "design.md", ["name_tables.py", "tests/test_model_families.py", "qwen3-0.6b"]),
    ("Adding a parallel dimension", "design.md", ["group_ranks", "layout_tag", "get_batch_on_this_cp_rank"]),
    ("Benchmarks", "benchmarks.md", ["python -m benchmarks.gpu_smoke", "$BENCHMARK_RESULTS_DIR",
                                     "~60 ns/element", "2.6x", "1.01x", "12-29x", "1.0-3.0x"]),
    ("Benchmarks: the GPU scripts", "gpu.md", ["--tiny", "--cpu", "fused AdamW", "BENCHMARK_RESULTS_DIR=$OUT"]),
]


@pytest.mark.parametrize(("section", "page", "figures"), REVIEW_MAP, ids=[row[0] for row in REVIEW_MAP])
def test_every_former_section_has_a_page_holding_its_figures(section, page, figures):
    path = ROOT / page if page == "README.md" else DOCS / page
    assert path.exists(), f"{section}: {page} is missing"
    text = " ".join(_read(path).split())
    missing = [figure for figure in figures if " ".join(figure.split()) not in text]
    assert not missing, f"{section}: {page} no longer holds {missing}"
