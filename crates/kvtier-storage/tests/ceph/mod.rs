//! A throwaway Ceph cluster with its S3 gateway for tests, run by `scripts/ceph-s3`. Shared by
//! the storage and daemon tests (included by path).
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kvtier_config::Secret;
use kvtier_config::l3::S3Section;

/// Per-request deadline of a store on this cluster. Generous: a cluster on a busy 2-core
/// machine can pause for seconds.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// `scripts/ceph-s3`, found from the including package's directory upwards.
fn script() -> PathBuf {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    loop {
        let candidate = dir.join("scripts/ceph-s3");
        if candidate.exists() {
            return candidate;
        }
        assert!(
            dir.pop(),
            "scripts/ceph-s3 not found above {}",
            env!("CARGO_MANIFEST_DIR")
        );
    }
}

/// A running throwaway cluster; stopped and removed on drop.
pub struct Ceph {
    pub dir: PathBuf,
    pub env: HashMap<String, String>,
}

impl Ceph {
    pub fn start() -> Ceph {
        let dir = std::env::temp_dir().join(format!("kvtier-ceph-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new(script())
            .arg("start")
            .arg(&dir)
            .output()
            .unwrap();
        let mut ceph = Ceph {
            env: HashMap::new(),
            dir,
        };
        assert!(
            out.status.success(),
            "ceph did not start (is it installed? scripts/setup installs it): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ceph.env = std::fs::read_to_string(ceph.dir.join("s3.env"))
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ceph
    }

    pub fn script(&self, cmd: &str) {
        let st = Command::new(script())
            .arg(cmd)
            .arg(&self.dir)
            .status()
            .unwrap();
        assert!(st.success(), "ceph-s3 {cmd} failed");
    }

    /// object_store cannot create buckets: a signed S3 CreateBucket through curl.
    pub fn create_bucket(&self, bucket: &str) {
        let out = Command::new("curl")
            .args([
                "-s",
                "-f",
                "-X",
                "PUT",
                "--aws-sigv4",
                "aws:amz:us-east-1:s3",
            ])
            .args(["-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD"])
            .arg("--user")
            .arg(format!(
                "{}:{}",
                self.env["S3_ACCESS_KEY"], self.env["S3_SECRET_KEY"]
            ))
            .arg(format!("{}/{bucket}", self.env["S3_ENDPOINT"]))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "CreateBucket failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    /// Makes the bucket and waits until the gateway stores and serves an object in it: a fresh
    /// cluster creates its data pools on first use, which can take seconds on a busy machine.
    pub async fn bucket_ready(&self, bucket: &str) {
        use kvtier_storage::Store as _;
        self.create_bucket(bucket);
        let cfg = self.config(bucket, "warm-up");
        let s3 = kvtier_storage::s3::S3Store::new(&cfg, Duration::from_secs(20)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let body = bytes::Bytes::from_static(b"warm");
            match s3.set("00", bytes::Bytes::new(), body).await {
                Ok(()) if s3.exists("00").await.unwrap_or(false) => return,
                Ok(()) => {}
                Err(e) => assert!(
                    std::time::Instant::now() < deadline,
                    "the S3 gateway never accepted a write: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `[l3.s3]` for `bucket` under `prefix` on this cluster (open it with [`TIMEOUT`]).
    pub fn config(&self, bucket: &str, prefix: &str) -> S3Section {
        S3Section {
            endpoint: Some(self.endpoint().into()),
            region: Some(self.env["S3_REGION"].clone()),
            bucket: bucket.into(),
            prefix: prefix.into(),
            access_key: Some(self.access_key().into()),
            secret_key: Secret(self.secret_key().into()),
            virtual_hosted: false,
        }
    }

    /// The gateway's URL.
    pub fn endpoint(&self) -> &str {
        &self.env["S3_ENDPOINT"]
    }

    /// The region the gateway answers for.
    pub fn region(&self) -> &str {
        &self.env["S3_REGION"]
    }

    /// The test user's access key id.
    pub fn access_key(&self) -> &str {
        &self.env["S3_ACCESS_KEY"]
    }

    /// The test user's secret key.
    pub fn secret_key(&self) -> &str {
        &self.env["S3_SECRET_KEY"]
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
