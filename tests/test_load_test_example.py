"""examples/load_test.py without servers: `server`, the example's workflows and /metrics are
stood in for, so the figures it derives from /metrics can be checked exactly."""

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def lt(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("load_test", None)
    import load_test
    yield load_test
    sys.modules.pop("load_test", None)


class FakeServer:
    """Counts like /metrics: each run_many call serves `workflows` workflows of 100 prompt tokens,
    40 device hits, 10 shared hits and 50 recomputed each (the warm-up: 100 device hits each)."""

    def __init__(self, lt, monkeypatch):
        self.prompt = self.device = self.shared = self.recomputed = 0
        self.runs = []

        @contextmanager
        def server(args, extra=()):
            self.prompt = self.device = self.shared = self.recomputed = 0
            yield "http://fake"

        def run_many(url, model, workflows, concurrency=4, seed=0, hints=True, max_tokens=16, **kw):
            self.runs.append((workflows, seed))
            self.prompt += 100 * workflows
            if seed == 99:                       # the warm-up
                self.device += 100 * workflows
            else:
                self.device += 40 * workflows
                self.shared += 10 * workflows
                self.recomputed += 50 * workflows
            return [SimpleNamespace(seconds=0.01 * (i + 1)) for i in range(workflows)]

        def get(url, **kw):
            text = (f"pbkv_prompt_tokens_total {self.prompt}\n"
                    f'pbkv_cache_hit_tokens_total{{tier="device"}} {self.device}\n'
                    f'pbkv_cache_hit_tokens_total{{tier="host"}} 0.0\n'
                    f'pbkv_cache_hit_tokens_total{{tier="disk"}} 0.0\n'
                    f'pbkv_cache_hit_tokens_total{{tier="shared"}} {self.shared}\n'
                    f"pbkv_cache_recomputed_tokens_total {self.recomputed}\n")
            return SimpleNamespace(text=text, status_code=200)

        monkeypatch.setattr(lt, "server", server)
        monkeypatch.setattr(lt.multi_agent, "run_many", run_many)
        monkeypatch.setattr(lt.httpx, "get", get)


def args(**kw):
    base = dict(model="tiny", policy="pbkv", device_tokens=4096, host_tokens=0, disk_tokens=0, threads=1,
                server_arg=[], min_workflows=4, workflows_per_client=1, seed=0, max_tokens=4,
                final_workflows=5, final_clients=1, learn_every=50)
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_cells_device_hit_rate_leaves_out_the_warm_up(lt, monkeypatch):
    FakeServer(lt, monkeypatch)
    r = lt.cell(args(), 1, True)
    # /metrics' own rate would be (2 * 100 + 4 * 40) / 600 = 0.6: the warm-up's all-device hits in it
    assert r["workflows"] == 4 and r["calls"] == 4
    assert r["device_hit_rate"] == pytest.approx(0.4)


def test_the_final_runs_recomputed_share_counts_shared_hits_as_hits(lt, monkeypatch):
    FakeServer(lt, monkeypatch)
    final, _ = lt.final_run(args())
    assert final["hit_rate"] == pytest.approx({"device": 0.4, "host": 0.0, "disk": 0.0, "shared": 0.1})
    assert final["recomputed_share"] == pytest.approx(0.5)     # 1 - (device + host + disk) said 0.6


@pytest.mark.parametrize("argv, message", [
    (["--learn-every", "0"], "load_test.py: error: --learn-every 0: must be at least 1\n"),
    (["--clients", "0"], "load_test.py: error: --clients '0': each cell needs at least 1 client\n"),
    (["--clients", "1,x"], "load_test.py: error: --clients '1,x': not a comma-separated list of whole numbers\n"),
    (["--final-clients", "0"], "load_test.py: error: --final-clients 0: must be at least 1\n"),
    (["--max-tokens", "two"], "load_test.py: error: argument --max-tokens: invalid int value: 'two'\n"),
])
def test_bad_arguments_are_one_line_before_any_server(lt, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(lt, "server", lambda *a, **k: pytest.fail("a server started"))
    monkeypatch.setattr(sys, "argv", ["load_test.py", *argv])
    with pytest.raises(SystemExit) as e:
        lt.main()
    assert e.value.code == 2
    assert capsys.readouterr().err == message


def test_json_is_written_after_each_cell(lt, monkeypatch, tmp_path, capsys):
    FakeServer(lt, monkeypatch)
    out = tmp_path / "figures.json"

    def final_run(args):
        assert [c["clients"] for c in json.loads(out.read_text())["cells"]] == [1, 1, 2, 2]
        raise RuntimeError("the final run's server died")

    monkeypatch.setattr(lt, "final_run", final_run)
    monkeypatch.setattr(sys, "argv", ["load_test.py", "--clients", "1,2", "--min-workflows", "1", "--json", str(out)])
    with pytest.raises(SystemExit) as e:
        lt.main()
    assert e.value.code == "load_test.py: the final run's server died"
    figures = json.loads(out.read_text())
    assert figures["final"] is None and len(figures["cells"]) == 4
    assert figures["cells"][0]["device_hit_rate"] == pytest.approx(0.4)
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]


def test_ctrl_c_keeps_the_cells_measured_and_says_so(lt, monkeypatch, tmp_path, capsys):
    fake = FakeServer(lt, monkeypatch)
    real = lt.multi_agent.run_many

    def run_many(url, model, workflows, concurrency=4, seed=0, **kw):
        if len(fake.runs) == 3:              # the second cell's measured run: Ctrl-C
            raise lt.multi_agent.Interrupted([], 0, workflows)
        return real(url, model, workflows, concurrency, seed, **kw)

    monkeypatch.setattr(lt.multi_agent, "run_many", run_many)
    out = tmp_path / "f.json"
    monkeypatch.setattr(sys, "argv", ["load_test.py", "--clients", "1", "--min-workflows", "1", "--json", str(out)])
    with pytest.raises(SystemExit) as e:
        lt.main()
    assert e.value.code == 130
    assert capsys.readouterr().err == f"\ninterrupted: 1 of 2 cells measured, in {out}; no final run\n"
    assert len(json.loads(out.read_text())["cells"]) == 1
