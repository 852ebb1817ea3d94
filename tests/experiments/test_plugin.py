"""Your own normalizer on the leaderboard: ``leaderboard --method module:function`` imports it from
the current directory, refuses a bad one in one sentence before any work, and adds it to an
existing run folder without retraining the methods already there."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cli_checks import one_sentence
from sharpattn import attend
from sharpattn import normalizers as nz
from sharpattn.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

#: the smallest leaderboard with a paired test (two seeds), in one process
TINY = [
    "leaderboard",
    "--quick",
    "--tasks",
    "flip_flop",
    "--methods",
    "softmax",
    "--seeds",
    "2",
    "--steps",
    "2",
    "--eval-sets",
    "1",
    "--eval-factor",
    "1",
    "--threads",
    "1",
    "--workers",
    "1",
]

ROOT = Path(__file__).resolve().parents[2]


def documented_example() -> str:
    """The ten-line example of docs/alternatives.md (softmax(g·s), a learnable per-head gain g):
    the test runs what the page shows."""
    page = (ROOT / "docs" / "alternatives.md").read_text(encoding="utf-8")
    section = page[page.index("## Your own normalizer on the leaderboard") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """``write(name, source)`` writes module ``name`` into the (current) tmp_path; the modules,
    sys.path and every plug-in registered meanwhile are restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(nz.available())
    written: list[str] = []

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)

    yield write
    for name in written:
        sys.modules.pop(name.replace("/__init__", "").replace("/", "."), None)
    for name in set(nz.available()) - before:
        nz.unregister(name)


BAD = {
    "no_colon": ("", "plug_no_colon", "package.module:function"),
    "no_module": ("", "plug_nowhere_xyz:fn", "no module named 'plug_nowhere_xyz'"),
    "no_attribute": ("def other(s, mask=None, **p): return s\n", "{m}:fn", "no attribute 'fn'"),
    "not_callable": ("fn = 3\n", "{m}:fn", "not a function or Normalizer"),
    "import_fails": ("raise RuntimeError('boom')\n", "{m}:fn", "RuntimeError: boom"),
    "syntax": ("def fn(:\n", "{m}:fn", "SyntaxError"),
    "raises": ("def fn(s, mask=None, **p):\n    raise KeyError('x')\n", "{m}:fn", "raised"),
    "nan": ("def fn(s, mask=None, **p):\n    return s * float('nan')\n", "{m}:fn", "NaN"),
    "shape": ("def fn(s, mask=None, **p):\n    return s[..., :1]\n", "{m}:fn", "shape"),
    "dtype": (
        "import torch\ndef fn(s, mask=None, **p):\n    return s.softmax(-1).double()\n",
        "{m}:fn",
        "float64",
    ),
    "masked": ("def fn(s, mask=None, **p):\n    return s.softmax(-1)\n", "{m}:fn", "masked"),
    "no_check_finite": ("def fn(s, mask=None):\n    return s\n", "{m}:fn", "check_finite"),
    "exits_on_import": (
        "import sys\nsys.exit(3)\n",
        "{m}:fn",
        "importing plug_exits_on_import called sys.exit with code 3",
    ),
    "exits_on_probe": (
        "import sys\ndef fn(s, mask=None, **p):\n    sys.exit(4)\n",
        "{m}:fn",
        "raised on a probe input: SystemExit: 4",
    ),
}

#: the head of a plug-in module holding a Normalizer entry `E` (after the head, one line)
ENTRY_HEAD = """\
from sharpattn.normalizers import Normalizer, Param, softmax
def f(s, mask=None, gain=1.0, bias=0.0, check_finite=True):
    return softmax(s, mask, check_finite=check_finite)
"""

#: Normalizer entries that cannot work: (its arguments after the function, what the sentence says)
BAD_ENTRIES = {
    "default_none": (
        "params=(Param('gain', None, 'g', learnable=True),)",
        "learnable parameter gain must be a real number",
        "default None",
    ),
    "default_list": (
        "params=(Param('gain', [1.0], 'g', learnable=True),)",
        "learnable parameter gain must be a real number",
        "default [1.0]",
    ),
    "default_text": (
        "params=(Param('gain', 'abc', 'g', learnable=True),)",
        "learnable parameter gain must be a real number",
        "default 'abc'",
    ),
    "default_nan": (
        "params=(Param('gain', float('nan'), 'g', learnable=True),)",
        "parameter gain has default nan",
        "a finite number",
    ),
    "default_inf": (
        "params=(Param('gain', float('inf'), 'g'),)",
        "parameter gain has default inf",
        "a finite number",
    ),
    "outside_range": (
        "params=(Param('gain', 5.0, 'g', learnable=True, low=0, high=1),)",
        "parameter gain has default 5.0",
        "in [0, 1]",
    ),
    "fixed_outside": (
        "params=(Param('bias', -1, 'b', kind='int', low=0),)",
        "parameter bias has default -1",
        "an integer >= 0",
    ),
    "bad_choice": (
        "params=(Param('bias', 'c', 'b', kind='choice', choices=('a', 'b')),)",
        "parameter bias has default 'c'",
        "one of 'a', 'b'",
    ),
    "learnable_bool": (
        "params=(Param('gain', True, 'g', learnable=True),)",
        "learnable parameter gain",
        "default True",
    ),
    "learnable_int": (
        "params=(Param('gain', 1, 'g', learnable=True, kind='int'),)",
        "learnable parameter gain",
        "kind 'int'",
    ),
    "duplicate": (
        "params=(Param('gain', 1.0, 'g', learnable=True), Param('gain', 2.0, 'h'))",
        "two parameters named 'gain'",
    ),
    "query_dependent": (
        "params=(Param('gain', 1.0, 'g', learnable=True),), query_dependent=('gian',)",
        "query_dependent names 'gian'",
        "(gain)",
    ),
    "query_dependent_text": (
        "params=(Param('gain', 1.0, 'g', learnable=True),), query_dependent='gain'",
        "query_dependent must be a tuple",
    ),
    "fused": ("fused='softmax'", "fused path 'softmax'", "declaring its family"),
    "fused_unknown": ("fused='nope'", "fused path 'nope'", "declaring its family"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_spec_is_refused_in_one_sentence_before_any_work(case, plugins, capsys, tmp_path):
    source, spec, needle = BAD[case]
    module = f"plug_{case}"
    if source:
        plugins(module, source)
    out = tmp_path / "run"
    assert main([*TINY, "--method", spec.format(m=module), "--out", str(out)]) == 2
    one_sentence(capsys, needle)
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_a_bad_entry_is_refused_naming_method_and_parameter(case, plugins, capsys, tmp_path):
    """Every fault of a Normalizer entry, checked in one place (the registry's validate) before
    the probe and before any training: one sentence naming the method and what is wrong."""
    args, *needles = BAD_ENTRIES[case]
    module = f"plug_entry_{case}"
    plugins(module, ENTRY_HEAD + f"E = Normalizer('x', f, 'f', 'me', True, {args})\n")
    out = tmp_path / "run"
    assert main([*TINY, "--method", f"{module}:E", "--out", str(out)]) == 2
    one_sentence(capsys, f"method '{module}:E'", *needles)
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(c for c in BAD_ENTRIES if not c.startswith("fused")))
def test_register_refuses_the_same_entries(case):
    """``register`` runs the same validation, so an entry registered from Python is held to it."""
    args, *needles = BAD_ENTRIES[case]
    namespace: dict = {}
    exec(ENTRY_HEAD + f"E = Normalizer('mine', f, 'f', 'me', True, {args})\n", namespace)
    with pytest.raises(ValueError) as err:
        nz.register(namespace["E"])
    assert "mine" not in nz.available()
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "method 'mine'" in message
    for needle in needles:
        assert needle in message


def test_every_registered_method_passes_validation():
    for name in nz.available():
        nz.get(name).validate()


def test_attend_refuses_a_fused_path_that_does_not_exist(register_normalizer):
    """A registered (not plug-in) entry may name a fast path; one that does not exist is refused
    by attend, which holds them, in one sentence instead of a KeyError inside a job."""
    import torch

    from sharpattn.attention import attend

    name = register_normalizer(
        nz.Normalizer("test-fused-nope", nz.softmax, "softmax", "test", True, fused="nope")
    )
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="names the fused path 'nope', which does not exist"):
        attend(q, q, q, name)


def test_ctrl_c_on_import_is_not_swallowed(plugins):
    from sharpattn.normalizers import plugin

    plugins("plug_ctrl_c", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        plugin.load("plug_ctrl_c:fn")


#: plug-ins that pass the probe (6 keys) and fail in a model: in training, or on long inputs
FAILING = {
    "nan_beyond_6": (
        "from sharpattn.normalizers import softmax\n"
        "def fn(s, mask=None, check_finite=True):\n"
        "    w = softmax(s, mask, check_finite=check_finite)\n"
        "    return w * float('nan') if s.shape[-1] > 6 else w\n",
        "at training step 1: it gave a NaN or infinite weight",
    ),
    "raises_when_long": (
        "from sharpattn.normalizers import softmax\n"
        "def fn(s, mask=None, check_finite=True):\n"
        "    if s.shape[-1] > 40:\n"
        "        raise RuntimeError('too long for me')\n"
        "    return softmax(s, mask, check_finite=check_finite)\n",
        "in evaluation at size 64: it raised RuntimeError: too long for me",
    ),
    "exits_in_training": (
        "import sys\nfrom sharpattn.normalizers import softmax\n"
        "def fn(s, mask=None, check_finite=True):\n"
        "    if s.shape[-1] > 6:\n"
        "        sys.exit(5)\n"
        "    return softmax(s, mask, check_finite=check_finite)\n",
        "at training step 1: it raised SystemExit: 5",
    ),
}


@pytest.mark.parametrize("case", sorted(FAILING))
def test_a_plugin_failing_in_a_model_stops_its_jobs_and_keeps_the_others(
    case, plugins, capsys, tmp_path
):
    """It stops its own jobs with one sentence (method, task, seed, step or size); the other
    methods finish, the report covers them, and the command exits with code 2."""
    source, where = FAILING[case]
    module = f"plug_fail_{case}"
    plugins(module, source)
    out = tmp_path / "run"
    assert main([*TINY, "--method", f"{module}:fn", "--out", str(out)]) == 2
    err = one_sentence(
        capsys,
        f"method '{module}:fn' failed on task flip_flop (seed 0) {where}",
        "(2 of its 2 jobs failed)",
        "the report covers the other methods",
    )
    assert "Traceback" not in err
    csv = (out / "leaderboard.csv").read_text().splitlines()
    assert [line.split(",")[1] for line in csv[1:]] == ["softmax"]
    assert (out / "report.md").is_file()


def test_a_run_whose_only_method_fails_writes_no_report(plugins, capsys, tmp_path):
    plugins("plug_fail_alone", FAILING["nan_beyond_6"][0])
    out = tmp_path / "run"
    args = [*TINY, "--methods", "plug_fail_alone:fn", "--out", str(out)]
    assert main(args) == 2
    one_sentence(capsys, "method 'plug_fail_alone:fn' failed", "no method finished")
    assert not (out / "report.md").exists()


def test_a_users_normalizer_joins_an_existing_run(plugins, capsys, tmp_path):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out)]) == 0
    trained = {p: p.stat().st_mtime_ns for p in (out / "train").rglob("*") if p.is_file()}
    assert trained

    plugins("plug_sharp", documented_example())
    # one flag: the folder's settings (tasks, methods, seeds, steps, ...) are the base
    assert main(["leaderboard", "--out", str(out), "--method", "plug_sharp:SHARP"]) == 0
    assert {p: p.stat().st_mtime_ns for p in trained} == trained  # softmax not retrained
    new = out / "train" / "flip_flop" / "plug_sharp_SHARP"
    assert sorted(p.name for p in new.iterdir()) == ["seed0", "seed1"]
    cfg = (out / "config.json").read_text()
    assert '"softmax"' in cfg and '"plug_sharp:SHARP"' in cfg

    csv = (out / "leaderboard.csv").read_text().splitlines()
    assert sorted(line.split(",")[1] for line in csv[1:]) == ["plug_sharp:SHARP", "softmax"]
    report = (out / "report.md").read_text()
    section = report[report.index("## plug_sharp:SHARP against every method") :]
    row = next(line for line in section.splitlines() if line.startswith("| softmax"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 5  # method, its score, difference, p, p on flip_flop
    assert "nan" not in row  # two steps solve nothing: tied seeds give "–", never NaN

    everything = {p: p.stat().st_mtime_ns for p in (out / "train").rglob("*") if p.is_file()}
    csv_before = (out / "leaderboard.csv").read_text()
    assert main(["leaderboard", "--out", str(out), "--method", "plug_sharp:SHARP"]) == 0
    assert {p: p.stat().st_mtime_ns for p in everything} == everything  # nothing retrained
    assert (out / "leaderboard.csv").read_text() == csv_before


def test_a_function_in_a_package_is_a_method_without_parameters(plugins, tmp_path):
    """A function (no Normalizer) is a method without parameters; probed, registered, run."""
    from sharpattn.experiments import leaderboard as lb
    from sharpattn.normalizers import plugin

    (tmp_path / "plug_pkg").mkdir()
    plugins("plug_pkg/__init__", "")
    plugins("plug_pkg/mod", "from sharpattn.normalizers import softmax as fn\n")
    spec = "plug_pkg.mod:fn"  # a module in a package
    cfg = lb.make_config("quick", methods=("softmax",), plugins=(spec,))
    assert cfg.methods == ("softmax", spec)
    assert plugin.ensure(spec).name == spec and not plugin.ensure(spec).learnable
    assert spec not in lb.seq.methods()  # the default set stays the registry's


def test_against_all_is_the_paired_t_test_over_seeds_of_the_mean_score():
    """The added method's row: against every other method, the difference of overall scores and
    scipy's paired t-test over seeds, on rows built by hand (two tasks, three seeds)."""
    from scipy import stats

    from sharpattn.experiments import leaderboard as lb

    acc = {
        "mine": [[0.9, 0.5], [0.8, 0.4], [1.0, 0.7]],
        "softmax": [[0.5, 0.1], [0.6, 0.3], [0.4, 0.0]],
        "sink": [[0.7, 0.2], [0.9, 0.5], [0.6, 0.6]],
    }
    rows = [
        {
            "task": "flip_flop",
            "method": m,
            "seed": s,
            "size": size,
            "acc": a[s][i],
            "token_acc": a[s][i],
        }
        for m, a in acc.items()
        for s in range(3)
        for i, size in enumerate((16, 64))
    ]
    got = {c["method"]: c for c in lb.against_all(rows, "mine", ["flip_flop"])}
    assert sorted(got) == ["sink", "softmax"]
    score = {m: [lb.seq.area([16, 64], a[s]) for s in range(3)] for m, a in acc.items()}
    for other in ("softmax", "sink"):
        diff = [x - y for x, y in zip(score["mine"], score[other], strict=True)]
        assert got[other]["diff"][0] == pytest.approx(sum(diff) / 3, rel=1e-12)
        p = stats.ttest_rel(score["mine"], score[other]).pvalue
        assert got[other]["p"] == pytest.approx(p, rel=1e-9)
        assert got[other]["tasks"]["flip_flop"] == pytest.approx(p, rel=1e-9)  # one task


def test_models_from_a_run_without_the_plug_in_is_refused(plugins, capsys, tmp_path):
    """--models-from only reads the other run: a plug-in it never trained is refused, naming
    it, before any work (it is not trained there)."""
    src, far = tmp_path / "src", tmp_path / "far"
    assert main([*TINY, "--out", str(src)]) == 0
    before = {p: p.stat().st_mtime_ns for p in src.rglob("*")}
    plugins("plug_sharp", documented_example())
    capsys.readouterr()
    args = [*TINY, "--method", "plug_sharp:SHARP", "--models-from", str(src), "--out", str(far)]
    assert main(args) == 2
    one_sentence(capsys, "no trained model for plug_sharp:SHARP on flip_flop (seeds 0, 1)")
    assert {p: p.stat().st_mtime_ns for p in src.rglob("*")} == before and not far.exists()


def guide_family_example() -> str:
    """The family example of docs/guide.md (softplus(s + b − log n), learnable b)."""
    page = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    section = page[page.index("#### A fast path for your normalizer") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_plugin_that_declares_a_family_gets_its_fast_path(plugins):
    """The guide's example as a plug-in module: probed, registered with the family's path, and
    that path (tiles) gives the naive path's output and gradients."""
    from sharpattn.attention.dispatch.fast import path_of
    from sharpattn.normalizers import plugin

    source = guide_family_example()
    assert (
        "nz.register(SOFTPLUS_ENTRY)" in source
    )  # the guide registers it; the plug-in loader will
    plugins("plug_family", source.replace("nz.register(SOFTPLUS_ENTRY)", ""))
    entry = plugin.load("plug_family:SOFTPLUS_ENTRY")
    assert entry.fused == "elementwise" and path_of(entry) is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    outs = {}
    for impl in ("naive", "fused"):
        qq = q.clone().requires_grad_()
        out = attend(qq, k, v, entry.name, causal=True, impl=impl)
        outs[impl] = (out, torch.autograd.grad(out.square().sum(), qq)[0])
    assert torch.allclose(outs["fused"][0], outs["naive"][0], atol=1e-12)
    assert torch.allclose(outs["fused"][1], outs["naive"][1], atol=1e-12)


def test_a_plugin_that_declares_a_row_normalised_family_gets_the_tile_path(plugins):
    """A plug-in RowNormalised without a kernel (sign(s)·|s|^p / Σ|s|^p, a row reference m =
    max |s|): probed, registered with the two-pass tile path, which gives the naive output and
    passes a float64 gradcheck on tiles that rows cross."""
    from sharpattn.attention.dispatch.fast import path_of
    from sharpattn.attention.masking import Masking
    from sharpattn.normalizers import plugin

    plugins(
        "plug_rownorm",
        """
        import torch
        from sharpattn import normalizers as nz
        from sharpattn.normalizers.families import RowNormalised

        def a(s, m, p=2.0):
            return (s.abs() / torch.where(m > 0, m, torch.ones_like(m))) ** p

        def u(s, m, p=2.0):
            return torch.sign(s) * a(s, m, p)

        FAM = RowNormalised(u, a, ref=torch.abs, constants=("p",))
        ENTRY = nz.Normalizer("x", FAM.weights, "sign(s)|s|^p / Σ|s|^p", "-", False,
                              params=(nz.Param("p", 2.0, "p >= 1", low=1.0),), family=FAM)
        """,
    )
    entry = plugin.load("plug_rownorm:ENTRY")
    assert entry.fused == "row_normalised" and path_of(entry) is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    outs = {}
    for impl in ("naive", "fused"):
        qq = q.clone().requires_grad_()
        out = attend(qq, k, v, entry.name, causal=True, impl=impl, p=3.0)
        outs[impl] = (out, torch.autograd.grad(out.square().sum(), qq)[0])
    assert torch.allclose(outs["fused"][0], outs["naive"][0], atol=1e-12)
    assert torch.allclose(outs["fused"][1], outs["naive"][1], atol=1e-12)
    masking = Masking.build(None, True, 6, 6, "cpu")

    def f(q, k, v):
        return path_of(entry)(q, k, v, masking, 0.5, False, blocks=(2, 3), p=3.0)[0]

    assert torch.autograd.gradcheck(f, [t.clone().requires_grad_() for t in (q, k, v)])


@pytest.mark.parametrize(
    "body, needle",
    [
        ("FAM = Elementwise(f, row, kernel='sigmoid')", "built-in kernel 'sigmoid'"),
        ("FAM = Elementwise(lambda s, r: 2 * f(s, r), row)", "other weights than its function"),
    ],
)
def test_a_plugin_family_that_is_not_its_function_is_refused(plugins, body, needle):
    from sharpattn.normalizers import plugin

    plugins(
        "plug_bad_family",
        f"""
        import torch
        from sharpattn import normalizers as nz
        from sharpattn.normalizers.families import Elementwise

        def f(s, r):
            return torch.sigmoid(s + r)

        def row(n, **_):
            return 0.0

        {body}
        OK = Elementwise(f, row)
        ENTRY = nz.Normalizer("x", OK.weights, "σ(s)", "-", False, family=FAM)
        """,
    )
    with pytest.raises(ValueError, match=needle):
        plugin.load("plug_bad_family:ENTRY")
