"""The `mossvox` console script: help, lazy commands, passthrough, `profile show`."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from cli.main import COMMANDS, Command, Group, Passthrough, _available, main
from profiles import load_profile

MOSSVOX = Path(sys.executable).parent / "mossvox"
REPO = Path(__file__).resolve().parents[2]


def mossvox(*args):
    return subprocess.run([str(MOSSVOX), *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


def test_help_lists_every_registered_command():
    result = mossvox("--help")
    assert result.returncode == 0, result.stderr
    for entry in COMMANDS:
        assert entry.name in result.stdout
    bench = mossvox("bench", "--help")
    assert bench.returncode == 0 and all(w in bench.stdout for w in ("ipc", "engine", "serve"))


def test_the_installed_command_runs_outside_the_repository(tmp_path):
    """Every package the commands import is installed (not only found beside the current
    directory): `make-checkpoint --help` reaches the model registry, `speech/` and torch."""
    result = subprocess.run([str(MOSSVOX), "make-checkpoint", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "realtime" in result.stdout and "sound-effect" in result.stdout


def test_help_imports_neither_torch_nor_any_command_module():
    code = textwrap.dedent("""
        import sys
        from cli.main import main
        assert main(["--help"]) == 0
        heavy = [m for m in sys.modules if m == "torch" or m.startswith("cli.commands.")
                 or m in ("msgspec", "yaml", "numpy")]
        print("HEAVY", heavy)
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_profile_show_prints_loadable_yaml_and_its_sha256(tmp_path):
    result = mossvox("profile", "show", "--profile", "low-latency",
                     "--set", "coalescing.max_wait_ms=2", "--set", "api.port=9001")
    assert result.returncode == 0, result.stderr
    expected = load_profile("low-latency", ["coalescing.max_wait_ms=2", "api.port=9001"])
    assert f"# sha256: {expected.sha256()}" in result.stdout.splitlines()
    assert yaml.safe_load(result.stdout)["api"]["port"] == 9001
    dump = tmp_path / "shown.yaml"
    dump.write_text(result.stdout)
    assert load_profile(str(dump)).sha256() == expected.sha256()


def test_profile_show_defaults_to_the_default_profile():
    result = mossvox("profile", "show")
    assert f"# sha256: {load_profile('default').sha256()}" in result.stdout


def test_profile_error_is_one_line_and_exit_status_2():
    result = mossvox("profile", "show", "--profile", "cpu", "--set", "talker.max_runing=3")
    assert result.returncode == 2
    assert "talker.max_runing" in result.stderr and "Traceback" not in result.stderr


def test_profile_list_names_the_shipped_profiles_and_what_each_is_for():
    result = mossvox("profile", "list")
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["cpu", "default", "high-concurrency", "low-latency"]
    assert "GPU-oriented serving of one model on one GPU." in lines[1]
    assert all(len(line.split()) > 3 for line in lines)  # a description after every name


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["no-such-command"]) == 2
    assert main(["profile", "show", "--no-such-flag"]) == 2


def test_unbuilt_command_says_not_available(capsys):
    table = (Command("later", "arrives later", "cli.commands.no_such_module"),)
    assert main(["later", "--anything"], commands=table) == 2
    assert "'later' is not available yet" in capsys.readouterr().err
    assert main(["--help"], commands=table) == 0
    assert "(not available yet)" in capsys.readouterr().out


def test_command_module_gets_profile_options(tmp_path, monkeypatch, capsys):
    (tmp_path / "probe_cmd.py").write_text(textwrap.dedent("""
        from profiles.arguments import profile_from_args
        def add_arguments(parser):
            parser.add_argument("--times", type=int, default=1)
        def run(args):
            p = profile_from_args(args)
            print(p.talker.max_running, args.times)
            return 5
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    table = (Command("probe", "probe", "probe_cmd"),)
    assert main(["probe", "--profile", "cpu", "--set", "talker.max_running=20",
                 "--set", "admission.max_running=20", "--times", "3"], commands=table) == 5
    assert capsys.readouterr().out.split() == ["20", "3"]
    assert main(["probe", "--set", "talker.nope=1"], commands=table) == 2
    assert "talker.nope" in capsys.readouterr().err


def test_passthrough_hands_over_the_rest_of_argv(tmp_path, monkeypatch):
    (tmp_path / "probe_bench.py").write_text(textwrap.dedent("""
        SEEN = []
        def main(argv):
            SEEN.append(list(argv))
            return 3
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    table = (Group("bench", "benchmarks", (Passthrough("ipc", "rings", "probe_bench"),)),)
    assert main(["bench", "ipc", "--quick", "--help", "x"], commands=table) == 3
    import probe_bench

    assert probe_bench.SEEN == [["--quick", "--help", "x"]]


def test_availability_is_found_on_disk():
    def available(module):
        return _available(Command("x", "x", module))

    assert available("cli.commands.profile") and available("profiles.schema")
    assert available("cli.commands")  # a package counts too
    assert not available("cli.commands.no_such_module")
    assert not available("no_such_package.cmd") and not available("api.no_such_pkg.cmd")


def test_profile_fields_documents_every_setting_with_its_default():
    import msgspec

    from profiles import Profile

    result = mossvox("profile", "fields")
    assert result.returncode == 0, result.stderr
    listed = [line.split(" = ")[0] for line in result.stdout.splitlines() if line[:1] != " "]
    expected = [f"{s.name}.{f.name}" for s in msgspec.structs.fields(Profile)
                for f in msgspec.structs.fields(s.type)]
    assert listed == expected
    assert "coalescing.max_wait_ms = 0.0" in result.stdout
    split = result.stdout.split("codec.split_chunks = false\n", 1)[1].splitlines()
    assert split[1] == "    in high-concurrency: true"  # the shipped profiles that set it
    fp8 = result.stdout.split("talker.fp8_weights = \"none\"\n", 1)[1].split("\ntalker.", 1)[0]
    assert "in high-concurrency" not in fp8 and "float8" in fp8  # opt-in: no shipped profile sets it


def test_profile_show_never_prints_an_api_key():
    result = mossvox("profile", "show", "--profile", "cpu", "--set", "api.keys=[sk-secret-1, sk-secret-2]")
    assert result.returncode == 0, result.stderr
    assert "sk-secret" not in result.stdout
    assert yaml.safe_load(result.stdout)["api"]["keys"] == ["<redacted>", "<redacted>"]
    assert "sk-secret" not in repr(load_profile("cpu", ["api.keys=[sk-secret-1]"]))


def test_user_facing_text_names_no_issue_numbers():
    for args in (("profile", "fields"), ("--help",), ("serve", "--help"), ("synth", "--help")):
        text = mossvox(*args).stdout
        assert text and not re.search(r"#\d|\bissue", text, re.IGNORECASE), args


def test_output_into_a_closed_pipe_ends_quietly():
    """`mossvox profile fields | head` when head has already gone: no BrokenPipeError traceback."""
    proc = subprocess.Popen([str(MOSSVOX), "profile", "fields"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # the reader leaves before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_bench_ipc_help_names_the_command_that_runs_it():
    result = mossvox("bench", "ipc", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: mossvox bench ipc")


def test_serve_a_missing_checkpoint_is_one_line_and_a_failure(tmp_path):
    (tmp_path / "empty").mkdir()
    for target, says in ((tmp_path / "nonexistent" / "dir", "no such checkpoint directory"),
                         (tmp_path / "empty", "no config.json")):
        result = mossvox("serve", str(target))
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and says in result.stderr and str(target) in result.stderr


def test_check_precision_prints_the_figures_and_its_verdict(tmp_path):
    """`mossvox check-precision` on a tiny random checkpoint: the three comparisons, the bound and
    PASS (exit 0), or FAIL (exit 1) against a bound nothing but bf16 itself meets; a profile
    without precision changes has nothing to check; no checkpoint is a one-line error."""
    from stages.tools.make_checkpoint import make_checkpoint

    model_dir = tmp_path / "tiny"
    make_checkpoint(model_dir, size="tiny")
    fp8 = ("--profile", "cpu", "--set", "talker.fp8_weights=backbone", "--set", "talker.fp8_scheme=w8a8",
           "--prompts", "2", "--frames", "8")
    passed = mossvox("check-precision", str(model_dir), *fp8)
    assert passed.returncode == 0, passed.stderr[-2000:]
    lines = passed.stdout.splitlines()
    assert "precision changes: talker.fp8_weights=backbone, talker.fp8_scheme=w8a8" in lines
    table = [line for line in lines if line.startswith(("bf16 vs fp32", "candidate vs bf16", "candidate vs fp32"))]
    assert len(table) == 3 and all(len(line.split()) == 6 for line in table)
    assert lines[-2].startswith("bound: candidate vs bf16: mean KL") and lines[-1] == "PASS"
    failed = mossvox("check-precision", str(model_dir), *fp8, "--max-kl", "0")
    assert failed.returncode == 1 and failed.stdout.splitlines()[-1] == "FAIL", failed.stderr[-2000:]
    assert "exceeded: KL" in failed.stdout
    nothing = mossvox("check-precision", str(model_dir), "--profile", "cpu")
    assert nothing.returncode == 0 and "nothing to check" in nothing.stdout
    missing = mossvox("check-precision", str(tmp_path / "none"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no config.json" in missing.stderr
