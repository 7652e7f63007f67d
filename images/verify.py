#!/usr/bin/env python3
"""Verifies OCI image archives written by images/build.sh; exits 1 on the first archive that fails.

Checks, for each archive: oci-layout, index.json, the manifest and the config are valid JSON of
the right media types; every blob's digest and size match its content; the config's diff_ids are
the digests of the uncompressed layers; the binary the image's Entrypoint names is a regular,
executable file in a layer; the user is 65532:65532 for the operator and root for the agent, and
that user is in /etc/passwd; the OCI annotations and io.containerd.image.name are present.
Prints each image's name and manifest digest.
"""

import gzip
import hashlib
import io
import json
import sys
import tarfile

ANNOTATIONS = [
    "org.opencontainers.image.source",
    "org.opencontainers.image.version",
    "org.opencontainers.image.revision",
    "org.opencontainers.image.created",
    "org.opencontainers.image.title",
    "org.opencontainers.image.licenses",
]
# image name -> (entrypoint, user)
EXPECTED = {
    "gpupool-operator": ("/usr/local/bin/gpupool-operator", "65532:65532"),
    "gpupool-device-plugin": ("/gpupool-device-plugin", "0:0"),
}


class Bad(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Bad(msg)


def verify(path):
    with tarfile.open(path) as tar:
        files = {m.name.lstrip("./"): tar.extractfile(m).read() for m in tar if m.isfile()}

    def blob(desc, what):
        digest = desc.get("digest", "")
        check(digest.startswith("sha256:"), f"{what}: digest {digest!r} is not sha256")
        data = files.get("blobs/sha256/" + digest[7:])
        check(data is not None, f"{what}: blob {digest} missing")
        check(hashlib.sha256(data).hexdigest() == digest[7:], f"{what}: blob {digest} content does not match")
        check(desc.get("size") == len(data), f"{what}: size {desc.get('size')} != {len(data)}")
        return data

    check(json.loads(files["oci-layout"]).get("imageLayoutVersion") == "1.0.0", "oci-layout")
    index = json.loads(files["index.json"])
    check(index.get("mediaType") == "application/vnd.oci.image.index.v1+json", "index mediaType")
    check(len(index.get("manifests", [])) == 1, "index: not exactly one manifest")
    mdesc = index["manifests"][0]
    ref = mdesc.get("annotations", {}).get("io.containerd.image.name", "")
    check(ref, "index: no io.containerd.image.name")
    name = ref.rsplit("/", 1)[-1].split(":")[0]
    check(name in EXPECTED, f"unexpected image name {ref}")
    check(mdesc.get("platform") == {"architecture": "amd64", "os": "linux"}, f"platform {mdesc.get('platform')}")
    manifest = json.loads(blob(mdesc, "manifest"))
    check(manifest.get("mediaType") == "application/vnd.oci.image.manifest.v1+json", "manifest mediaType")
    for where, ann in (("index", index.get("annotations", {})), ("manifest", manifest.get("annotations", {}))):
        for key in ANNOTATIONS:
            check(ann.get(key), f"{where}: annotation {key} missing")
    version = manifest["annotations"]["org.opencontainers.image.version"]
    check(ref.endswith(":" + version), f"{ref} is not tagged with version {version}")
    check(manifest["config"].get("mediaType") == "application/vnd.oci.image.config.v1+json", "config mediaType")
    config = json.loads(blob(manifest["config"], "config"))

    diff_ids = config.get("rootfs", {}).get("diff_ids", [])
    check(len(diff_ids) == len(manifest["layers"]), "diff_ids and layers differ in number")
    tree = {}
    for i, (ldesc, diff_id) in enumerate(zip(manifest["layers"], diff_ids)):
        check(ldesc.get("mediaType") == "application/vnd.oci.image.layer.v1.tar+gzip", f"layer {i} mediaType")
        raw = gzip.decompress(blob(ldesc, f"layer {i}"))
        check("sha256:" + hashlib.sha256(raw).hexdigest() == diff_id, f"layer {i}: diff_id does not match")
        with tarfile.open(fileobj=io.BytesIO(raw)) as layer:
            for m in layer:
                tree["/" + m.name.lstrip("./")] = (m, layer.extractfile(m).read() if m.isfile() else None)

    entry, user = EXPECTED[name]
    cfg = config.get("config", {})
    check(cfg.get("Entrypoint") == [entry], f"Entrypoint {cfg.get('Entrypoint')} != [{entry}]")
    check(cfg.get("User") == user, f"User {cfg.get('User')!r} != {user!r}")
    member = tree.get(entry, (None, None))[0]
    check(member is not None and member.isfile(), f"{entry} is not a file in the layers")
    check(member.mode & 0o111, f"{entry} is not executable")
    check(tree[entry][1][:4] == b"\x7fELF", f"{entry} is not an ELF binary")
    passwd = (tree.get("/etc/passwd", (None, b""))[1] or b"").decode()
    uid = user.split(":")[0]
    check(any(line.split(":")[2] == uid for line in passwd.splitlines() if line.count(":") >= 6),
          f"uid {uid} not in /etc/passwd")
    check(tree.get("/etc/ssl/certs/ca-certificates.crt", (None, b""))[1], "no CA bundle")
    for bad in ("/etc/resolv.conf", "/etc/hostname", "/etc/machine-id", "/bin/sh"):
        check(bad not in tree, f"{bad} is in the image")
    print(f"ok  {ref}  {mdesc['digest']}")


def main(paths):
    failed = False
    for path in paths:
        try:
            verify(path)
        except (Bad, KeyError, ValueError, tarfile.TarError, OSError) as e:
            print(f"FAIL {path}: {type(e).__name__}: {e}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
