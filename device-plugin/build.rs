//! Compiles the kubelet gRPC APIs in `../proto` at build time.
//!
//! `protox` parses the `.proto` files in pure Rust, so a bare machine without a
//! system `protoc` can build the crate; `tonic-prost-build` turns the resulting
//! descriptor set into prost messages and tonic clients/servers.

use std::path::PathBuf;

/// The protos, relative to the `proto/` include directory.
const PROTOS: [&str; 2] = [
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not with env!(): a build script binary can be reused from
    // a shared target directory by a checkout at another path.
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("..").join("proto");
    for file in PROTOS {
        println!("cargo:rerun-if-changed={}", proto_root.join(file).display());
    }
    let descriptors = protox::compile(PROTOS, [&proto_root])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
