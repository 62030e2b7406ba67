//! kvtierctl as an operator runs it: the real binary, its stdout and exit status.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn kvtierctl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierctl"))
        .args(args)
        .output()
        .expect("kvtierctl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn keys_prints_the_sglang_chain() {
    let (ok, out, err) = kvtierctl(&["keys", "--page-size", "4", "--tokens", "1,2,3,4,5,6,7,8,9"]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72\n\
         4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6\n"
    );
}

#[test]
fn keys_from_a_file_and_in_a_namespace() {
    let dir = std::env::temp_dir().join(format!("kvtierctl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens.txt");
    std::fs::write(&file, "1 2 3 4\n5,6,7,8\n").unwrap();
    let (ok, from_file, err) = kvtierctl(&[
        "keys",
        "--page-size",
        "4",
        "--tokens-file",
        file.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let (_, inline, _) = kvtierctl(&["keys", "--page-size", "4", "--tokens", "1,2,3,4,5,6,7,8"]);
    assert_eq!(from_file, inline);
    let (ok, tenant, err) = kvtierctl(&[
        "keys",
        "--page-size",
        "4",
        "--tokens",
        "1,2,3,4,5,6,7,8",
        "--namespace",
        "tenant=acme",
    ]);
    assert!(ok, "{err}");
    assert_eq!(tenant.lines().count(), 2);
    assert!(tenant.lines().zip(inline.lines()).all(|(a, b)| a != b));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_input_is_a_clear_error() {
    let (ok, _, err) = kvtierctl(&["keys", "--page-size", "0", "--tokens", "1"]);
    assert!(!ok);
    assert!(err.contains("page_size"), "{err}");
    let (ok, _, err) = kvtierctl(&[
        "keys",
        "--page-size",
        "4",
        "--tokens",
        "1",
        "--namespace",
        "colour=red",
    ]);
    assert!(!ok);
    assert!(err.contains("unknown field \"colour\""), "{err}");
}

#[test]
fn layout_prints_geometry() {
    let (ok, out, err) = kvtierctl(&[
        "layout",
        "--model-id",
        "m",
        "--dtype",
        "bf16",
        "--num-layers",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "64",
        "--page-size",
        "16",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("page_bytes     8192"), "{out}");
    assert!(out.contains("slot_stride    8192"), "{out}");
    let (ok, _, err) = kvtierctl(&[
        "layout",
        "--model-id",
        "m",
        "--dtype",
        "int3",
        "--num-layers",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "64",
        "--page-size",
        "16",
    ]);
    assert!(!ok && err.contains("dtype"), "{err}");
}
