//! Generates the gRPC code and a descriptor set (for server reflection) from `proto/`.
//! protoc comes from the protoc-bin-vendored crate: nothing is downloaded or installed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not compiled in: a target directory shared by checkouts at other
    // paths may reuse this script's binary.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let protos = [
        "kvtier/v1/common.proto",
        "kvtier/v1/host.proto",
        "kvtier/v1/storage.proto",
        "kvtier/v1/admin.proto",
        "kvtier/v1/agent.proto",
        "sglang/runtime/hicache/storage.proto",
    ]
    .map(|p| root.join(p));
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Object bytes as `bytes::Bytes`: chunks are sliced from and into buffers without copies.
    // So are a prompt's packed tokens (64 KB for 1,000 pages): a handler hashes them where
    // they arrived, with no copy out of the receive buffer.
    config.bytes([
        ".kvtier.v1.ObjectChunk.data",
        ".kvtier.v1.SetObjectChunk.data",
        ".kvtier.v1.MatchRequest.packed_tokens",
        ".kvtier.v1.InsertRequest.packed_tokens",
        ".kvtier.v1.PagesLookupRequest.packed_tokens",
        ".kvtier.v1.LoadPagesRequest.packed_tokens",
        ".kvtier.v1.SavePagesRequest.packed_tokens",
    ]);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("kvtier_descriptor.bin"))
        .compile_with_config(config, &protos, std::slice::from_ref(&root))?;
    println!("cargo:rerun-if-changed={}", root.display());
    Ok(())
}
