#!/usr/bin/env python3
"""Verifies OCI image archives written by images/build.sh; exits 1 on the first archive that fails.

Checks, for each archive: oci-layout, index.json, the manifest and the config are valid JSON of
the right media types; every blob's digest and size match its content; the config's diff_ids are
the digests of the uncompressed layers; the binary the image's Entrypoint names is a regular,
executable file in a layer; the user is 65532:65532 for the operator and root for the agent, and
that user is in /etc/passwd; the OCI annotations and io.containerd.image.name are present.
Prints each image's name and manifest digest.

Usage: verify.py ARCHIVE...  |  verify.py --self-test ARCHIVE (a good archive passes, and copies
with a changed blob, another user, a missing annotation fail)
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


def rewrite(path, out, edit):
    """Copies an archive to out after edit(files) changed its {name: bytes}."""
    with tarfile.open(path) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    edit(files)
    with tarfile.open(out, "w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def put(files, data):
    digest = hashlib.sha256(data).hexdigest()
    files["blobs/sha256/" + digest] = data
    return {"digest": "sha256:" + digest, "size": len(data)}


def self_test(path):
    """The verifier must reject a blob whose content changed and, digests kept consistent, a
    config with another user or without an annotation."""
    import tempfile

    def manifest_of(files):
        index = json.loads(files["index.json"])
        return index, json.loads(files["blobs/sha256/" + index["manifests"][0]["digest"][7:]])

    def corrupt_blob(files):
        _, manifest = manifest_of(files)
        name = "blobs/sha256/" + manifest["config"]["digest"][7:]
        files[name] = files[name] + b" "

    def consistent(change):
        def edit(files):
            index, manifest = manifest_of(files)
            config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"][7:]])
            change(config, manifest)
            manifest["config"].update(put(files, json.dumps(config).encode()))
            index["manifests"][0].update(put(files, json.dumps(manifest).encode()))
            files["index.json"] = json.dumps(index).encode()
        return edit

    def other_user(config, _):
        config["config"]["User"] = "12345:12345"

    def no_revision(_, manifest):
        del manifest["annotations"]["org.opencontainers.image.revision"]

    verify(path)
    with tempfile.TemporaryDirectory() as tmp:
        for label, edit in (("changed blob", corrupt_blob), ("other user", consistent(other_user)),
                            ("no revision annotation", consistent(no_revision))):
            out = f"{tmp}/bad.tar"
            rewrite(path, out, edit)
            try:
                verify(out)
            except Bad as e:
                print(f"ok  rejects {label}: {e}")
                continue
            raise Bad(f"self-test: an archive with {label} passed")


def main(paths):
    if paths[:1] == ["--self-test"]:
        try:
            self_test(paths[1])
        except Bad as e:
            print(f"FAIL {e}", file=sys.stderr)
            return 1
        return 0
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
