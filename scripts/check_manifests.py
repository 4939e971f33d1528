"""Consistency of deploy/kubernetes with the server (run by scripts/check-manifests).

Reads the kustomization's resources with PyYAML and checks, against `zerolayer serve --help`
and the gateway's metric names:
- every `--flag` in the container args is a flag of `zerolayer serve`;
- --http-listen / --quic-listen ports are the container ports (TCP / UDP) the probes and both
  Services target, and the readiness probe asks /health over HTTPS when --tls-cert is set;
- terminationGracePeriodSeconds > --drain-secs + the preStop pause;
- the HPA's and the adapter rules' metrics are exported by the gateway (metrics.rs);
- the model path the server is given is where the init container's `zerolayer pull` writes;
- every metric the Grafana dashboard (deploy/grafana) queries is exported by the gateway.
"""

import argparse
import json
import pathlib
import re
import sys

import yaml


def fail(msg):
    print(f"check-manifests: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve-help", required=True)
    ap.add_argument("--metrics-source", required=True)
    ap.add_argument("dir", type=pathlib.Path)
    a = ap.parse_args()
    help_text = pathlib.Path(a.serve_help).read_text()
    flags = set(re.findall(r"--([a-z0-9-]+)", help_text))
    if "http-listen" not in flags:
        fail(f"`zerolayer serve --help` lists no --http-listen: {help_text[:200]!r}")
    exported = set(re.findall(r'"(zerolayer_[a-z_]+)', pathlib.Path(a.metrics_source).read_text()))

    kustomization = yaml.safe_load((a.dir / "kustomization.yaml").read_text())
    objects = {}
    for res in kustomization["resources"]:
        for doc in yaml.safe_load_all((a.dir / res).read_text()):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc

    deploy = objects[("Deployment", "zerolayer")]
    pod = deploy["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["name"] == "zerolayer")
    if server["command"][-1] != "serve":
        fail(f"the container does not run `zerolayer serve`: {server['command']}")
    args = dict(arg[2:].split("=", 1) if "=" in arg else (arg[2:], "") for arg in server["args"])
    for flag in args:
        if flag not in flags:
            fail(f"--{flag} is not a flag of `zerolayer serve`")
    http_port = int(args["http-listen"].rsplit(":", 1)[1])
    quic_port = int(args["quic-listen"].rsplit(":", 1)[1])
    ports = {p["name"]: (p["containerPort"], p.get("protocol", "TCP")) for p in server["ports"]}
    if ports.get("https") != (http_port, "TCP") or ports.get("quic") != (quic_port, "UDP"):
        fail(f"container ports {ports} do not match --http-listen {http_port} / --quic-listen {quic_port}")
    ready = server["readinessProbe"]["httpGet"]
    if ready["path"] != "/health" or ready["port"] not in ("https", http_port):
        fail(f"readiness probe {ready} is not /health on the HTTP port")
    if ("tls-cert" in args) != (ready.get("scheme") == "HTTPS"):
        fail("the readiness probe's scheme does not match whether --tls-cert makes the port HTTPS")
    for probe in ("livenessProbe", "startupProbe"):
        port = server[probe].get("tcpSocket", server[probe].get("httpGet", {})).get("port")
        if port not in ("https", http_port):
            fail(f"{probe} targets port {port}")
    drain = int(args.get("drain-secs", "30"))
    pause = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    if grace <= drain + pause:
        fail(f"terminationGracePeriodSeconds {grace} <= --drain-secs {drain} + preStop {pause}")
    for name in ("zerolayer", "zerolayer-replicas"):
        svc = objects[("Service", name)]
        for p in svc["spec"]["ports"]:
            want = ports.get(p["targetPort"]) if isinstance(p["targetPort"], str) else None
            if want is None or want[1] != p.get("protocol", "TCP"):
                fail(f"Service {name} port {p} does not target a container port of its protocol")
    hpa = objects[("HorizontalPodAutoscaler", "zerolayer")]
    for m in hpa["spec"]["metrics"]:
        metric = m["pods"]["metric"]["name"]
        if metric not in exported:
            fail(f"the HPA scales on {metric}, which the gateway does not export")
    rules = yaml.safe_load(objects[("ConfigMap", "zerolayer-prometheus-adapter-rules")]["data"]["config.yaml"])
    for r in rules["rules"]:
        if r["name"]["matches"] not in exported:
            fail(f"adapter rule for {r['name']['matches']}, which the gateway does not export")
    init = pod["initContainers"][0]
    home = next(e["value"] for e in init["env"] if e["name"] == "ZEROLAYER_HOME")
    if init["command"][-1] != "pull" or not args["model"].startswith(home + "/"):
        fail(f"--model {args['model']} is not where `zerolayer pull` writes ({home})")
    dashboard = json.loads((a.dir.parent / "grafana" / "zerolayer-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"(zerolayer_[a-z_]+?)(?:_bucket)?\{", target["expr"]):
                if metric not in exported:
                    fail(f"dashboard panel {panel['title']!r} queries {metric}, not exported")
    print(f"check-manifests: {len(objects)} objects consistent with `zerolayer serve` "
          f"(ports {http_port}/tcp {quic_port}/udp, drain {drain} s, grace {grace} s)")


if __name__ == "__main__":
    main()
