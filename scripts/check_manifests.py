"""Checks deploy/kubernetes as Kubernetes receives it (run by scripts/check-manifests).

Every kustomization (base, each overlay, prometheus-adapter) is rendered with `kubectl
kustomize` (the same kustomize `kubectl apply -k` runs), and every rendered object is validated
against the Kubernetes API schemas of the oldest release we support (1.28) and of the newest
kubernetes-validate knows, strictly (unknown fields rejected). Then each rendering that has the
Deployment is checked against the server (`zerolayer serve --help`, the gateway's metric names,
the default model's file name):
- every `--flag` in the container args is a flag of `zerolayer serve`;
- --http-listen / --quic-listen ports are the container ports (TCP / UDP) the probes and both
  Services target, and the readiness probe (and the Prometheus scrape annotation) uses HTTPS
  exactly when --tls-cert is set, with the certificate from a mounted Secret;
- terminationGracePeriodSeconds > --drain-secs + the preStop pause (`zerolayer sleep N`, a
  command of the binary);
- --model is the default model's file name (weight-cache's DEFAULT_MODEL_FILE) where the init
  container's (and the model Job's) `zerolayer pull` writes it, on the volume they share;
- every container runs the image zerolayer:VERSION (the crate's version), `images:` applied;
- the HPA's and the adapter rules' metrics are exported by the gateway (metrics.rs), and the
  rules land in a namespace of their own;
- every metric the Grafana dashboard (deploy/grafana) queries is exported by the gateway.
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys

import yaml
from kubernetes_validate import utils as kv

OLDEST = "1.28.0"


def fail(msg):
    print(f"check-manifests: {msg}", file=sys.stderr)
    sys.exit(1)


def render(kubectl, directory):
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"kubectl kustomize {directory} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(name, objects, versions):
    for version in versions:
        for obj in objects:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as e:
                fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} is not valid for Kubernetes "
                     f"{version}: {e.message} (at /{'/'.join(map(str, e.path))})")
            except Exception as e:  # the schema is missing, a version kubernetes-validate lacks
                fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} for Kubernetes {version}: {e}")


def flags_of(container):
    return dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in container.get("args", []))


def check_app(name, objects, ctx):
    """The Deployment and what goes with it, against the server."""
    def one(kind, obj_name):
        found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == obj_name]
        if len(found) != 1:
            fail(f"{name}: expected one {kind} {obj_name}, found {len(found)}")
        return found[0]

    deploy = one("Deployment", "zerolayer")
    pod = deploy["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["name"] == "zerolayer")
    if server["command"] != ["zerolayer", "serve"]:
        fail(f"{name}: the container does not run `zerolayer serve`: {server['command']}")
    args = flags_of(server)
    for flag in args:
        if flag not in ctx.flags:
            fail(f"{name}: --{flag} is not a flag of `zerolayer serve`")
    http_port = int(args["http-listen"].rsplit(":", 1)[1])
    quic_port = int(args["quic-listen"].rsplit(":", 1)[1])
    ports = {p["name"]: (p["containerPort"], p.get("protocol", "TCP")) for p in server["ports"]}
    tcp_name = next((n for n, p in ports.items() if p == (http_port, "TCP")), None)
    udp_name = next((n for n, p in ports.items() if p == (quic_port, "UDP")), None)
    if tcp_name is None or udp_name is None:
        fail(f"{name}: container ports {ports} do not match --http-listen {http_port} / --quic-listen {quic_port}")
    tls = "tls-cert" in args
    if tls != ("tls-key" in args):
        fail(f"{name}: --tls-cert and --tls-key come together")
    ready = server["readinessProbe"]["httpGet"]
    if ready["path"] != "/health" or ready["port"] not in (tcp_name, http_port):
        fail(f"{name}: readiness probe {ready} is not /health on the HTTP port")
    if (ready.get("scheme", "HTTP") == "HTTPS") != tls:
        fail(f"{name}: the readiness probe's scheme {ready.get('scheme', 'HTTP')} does not match "
             f"whether --tls-cert makes the port HTTPS ({tls})")
    scrape = deploy["spec"]["template"]["metadata"].get("annotations", {})
    if scrape.get("prometheus.io/scheme") != ("https" if tls else "http") or \
            int(scrape.get("prometheus.io/port", -1)) != http_port:
        fail(f"{name}: the Prometheus scrape annotations {scrape} do not match the HTTP port")
    for probe in ("livenessProbe", "startupProbe"):
        port = server[probe].get("tcpSocket", server[probe].get("httpGet", {})).get("port")
        if port not in (tcp_name, http_port):
            fail(f"{name}: {probe} targets port {port}")
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_at(container, path):
        """The pod volume mounted at the directory holding `path`, and whether read-only."""
        for m in container.get("volumeMounts", []):
            if path.startswith(m["mountPath"].rstrip("/") + "/"):
                return m["name"], m.get("readOnly", False)
        fail(f"{name}: {container['name']} has no volume mounted over {path}")

    if tls:
        for flag in ("tls-cert", "tls-key"):
            vol, _ = volume_at(server, args[flag])
            if "secret" not in volumes[vol]:
                fail(f"{name}: --{flag} {args[flag]} is not on a Secret volume")
    drain = int(args.get("drain-secs", "30"))
    hook = server["lifecycle"]["preStop"]
    if "sleep" in hook:
        fail(f"{name}: the preStop `sleep` action needs Kubernetes 1.30; use `zerolayer sleep`")
    cmd = hook["exec"]["command"]
    if cmd[:2] != ["zerolayer", "sleep"] or len(cmd) != 3 or not cmd[2].isdigit():
        fail(f"{name}: preStop {cmd} is not `zerolayer sleep SECONDS`")
    if "sleep" not in ctx.subcommands:
        fail(f"{name}: preStop runs `zerolayer sleep`, which `zerolayer --help` does not list")
    pause = int(cmd[2])
    grace = pod["terminationGracePeriodSeconds"]
    if grace <= drain + pause:
        fail(f"{name}: terminationGracePeriodSeconds {grace} <= --drain-secs {drain} + preStop {pause}")

    # The model: the file `zerolayer pull` writes, on the volume the server reads.
    model = args["model"]
    if pathlib.PurePosixPath(model).name != ctx.model_file:
        fail(f"{name}: --model {model} is not the default model's file {ctx.model_file}, "
             "which `zerolayer pull` writes")
    model_volume, _ = volume_at(server, model)
    pullers = [(f"init container {c['name']}", c, pod["volumes"]) for c in pod.get("initContainers", [])]
    for job in (o for o in objects if o["kind"] == "Job"):
        jpod = job["spec"]["template"]["spec"]
        pullers += [(f"Job {job['metadata']['name']}", c, jpod["volumes"]) for c in jpod["containers"]]
    if not pullers:
        fail(f"{name}: nothing runs `zerolayer pull` to put {model} in place")
    for what, c, vols in pullers:
        if c["command"] != ["zerolayer", "pull"]:
            fail(f"{name}: {what} runs {c['command']}, not `zerolayer pull`")
        home = next((e["value"] for e in c.get("env", []) if e["name"] == "ZEROLAYER_HOME"), None)
        if home is None or str(pathlib.PurePosixPath(home) / ctx.model_file) != model:
            fail(f"{name}: {what} writes {home}/{ctx.model_file}, the server reads {model}")
        vol, _ = volume_at(c, model)
        theirs = next(v for v in vols if v["name"] == vol)
        if what.startswith("init") and vol != model_volume:
            fail(f"{name}: {what} pulls into volume {vol}, the server reads volume {model_volume}")
        if what.startswith("Job"):
            claim = theirs.get("persistentVolumeClaim", {}).get("claimName")
            if claim is None or claim != volumes[model_volume].get("persistentVolumeClaim", {}).get("claimName"):
                fail(f"{name}: {what} fills {theirs}, the server reads {volumes[model_volume]}")

    for svc_name in ("zerolayer", "zerolayer-replicas"):
        svc = one("Service", svc_name)
        for p in svc["spec"]["ports"]:
            want = ports.get(p["targetPort"]) if isinstance(p["targetPort"], str) else None
            if want is None or want[1] != p.get("protocol", "TCP"):
                fail(f"{name}: Service {svc_name} port {p} does not target a container port of its protocol")
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        for m in hpa["spec"]["metrics"]:
            metric = m["pods"]["metric"]["name"]
            if metric not in ctx.exported:
                fail(f"{name}: the HPA scales on {metric}, which the gateway does not export")
    return f"ports {http_port}/tcp ({'HTTPS' if tls else 'HTTP'}) {quic_port}/udp, drain {drain} s + preStop {pause} s < grace {grace} s"


def check_images(name, objects, ctx):
    want = f"zerolayer:{ctx.version}"
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if c["image"] != want:
                fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} container {c['name']} runs "
                     f"{c['image']}, not {want} (the `images:` override)")


def check_adapter(name, objects, ctx):
    for cm in objects:
        if cm["kind"] != "ConfigMap" or "config.yaml" not in cm.get("data", {}):
            continue
        if cm["metadata"].get("namespace") in (None, "", "default"):
            fail(f"{name}: the adapter rules must land in prometheus-adapter's namespace, not "
                 f"{cm['metadata'].get('namespace')!r}")
        for r in yaml.safe_load(cm["data"]["config.yaml"])["rules"]:
            if r["name"]["matches"] not in ctx.exported:
                fail(f"{name}: adapter rule for {r['name']['matches']}, which the gateway does not export")
        return f"rules in namespace {cm['metadata']['namespace']}"
    fail(f"{name}: no ConfigMap with the adapter's config.yaml")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubectl", required=True)
    ap.add_argument("--zerolayer", required=True, help="the zerolayer binary")
    ap.add_argument("--metrics-source", required=True)
    ap.add_argument("--model-file-source", required=True)
    ap.add_argument("dir", type=pathlib.Path)
    a = ap.parse_args()

    class Ctx:
        pass
    ctx = Ctx()
    run = lambda *args: subprocess.run([a.zerolayer, *args], capture_output=True, text=True, check=True).stdout
    ctx.flags = set(re.findall(r"--([a-z0-9-]+)", run("serve", "--help")))
    if "http-listen" not in ctx.flags:
        fail("`zerolayer serve --help` lists no --http-listen")
    ctx.subcommands = set(re.findall(r"^  ([a-z]+) ", run("--help"), re.M))
    ctx.version = run("--version").split()[1]
    ctx.exported = set(re.findall(r'"(zerolayer_[a-z_]+)', pathlib.Path(a.metrics_source).read_text()))
    m = re.search(r'DEFAULT_MODEL_FILE: &str = "([^"]+)"', pathlib.Path(a.model_file_source).read_text())
    if not m:
        fail(f"no DEFAULT_MODEL_FILE in {a.model_file_source}")
    ctx.model_file = m.group(1)
    versions = [OLDEST, kv.latest_version()]

    kustomizations = sorted(p.parent for p in a.dir.rglob("kustomization.yaml")
                            if yaml.safe_load(p.read_text())["kind"] == "Kustomization")
    if not kustomizations:
        fail(f"no kustomization under {a.dir}")
    for directory in kustomizations:
        name = str(directory.relative_to(a.dir))
        objects = render(a.kubectl, directory)
        validate(name, objects, versions)
        kinds = {o["kind"] for o in objects}
        if "Deployment" in kinds:
            check_images(name, objects, ctx)
            what = check_app(name, objects, ctx)
        else:
            what = check_adapter(name, objects, ctx)
        print(f"check-manifests: {name}: {len(objects)} objects valid for Kubernetes "
              f"{' and '.join(v.rsplit('.', 1)[0] for v in versions)}; {what}")

    dashboard = json.loads((a.dir.parent / "grafana" / "zerolayer-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"(zerolayer_[a-z_]+?)(?:_bucket)?\{", target["expr"]):
                if metric not in ctx.exported:
                    fail(f"dashboard panel {panel['title']!r} queries {metric}, not exported")
    print(f"check-manifests: {len(kustomizations)} kustomizations consistent with `zerolayer "
          f"{ctx.version}` (model {ctx.model_file}); the Grafana dashboard's metrics are exported")


if __name__ == "__main__":
    main()
