//! Compiles the kubelet gRPC APIs in `../proto` at build time.
//!
//! `protox` parses the `.proto` files in pure Rust, so a bare machine without a
//! system `protoc` can build the crate; `tonic-prost-build` turns the resulting
//! descriptor set into prost messages and tonic clients/servers.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let files = [
        proto_root.join("deviceplugin/v1beta1/api.proto"),
        proto_root.join("podresources/v1/api.proto"),
    ];
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let descriptors = protox::compile(&files, [&proto_root])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
