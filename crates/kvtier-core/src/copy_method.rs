//! How a GPU device moves a batch of page runs between its memory and the host pool
//! (`device.copy_method`), and which method a device uses once each has been self-checked.
//!
//! The methods themselves live in kvtier-device; this type only decides. Every method a
//! device offers copies test pages both ways at start-up and compares the bytes (its
//! self-check). A method that fails is disabled; `auto` takes the fastest that passed; a
//! named method that failed gives way to the fastest that passed, and the device reports why.

use serde::{Deserialize, Serialize};

/// One way of moving a batch of (source, destination, length) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// One `cuMemcpyBatchAsync` per batch (driver 12.8 or newer; the 13.0 signature when the
    /// driver is 13 or newer).
    Batch,
    /// A gather/scatter kernel: one launch per batch, the host pool mapped into the device.
    Kernel,
    /// One `cuMemcpyAsync` per contiguous run: works on every driver.
    PerRun,
}

impl Method {
    /// Every method, in the order devices check them.
    pub const ALL: [Method; 3] = [Method::Batch, Method::Kernel, Method::PerRun];

    /// The name used in config files, logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Method::Batch => "batch",
            Method::Kernel => "kernel",
            Method::PerRun => "per_run",
        }
    }
}

/// `device.copy_method`: a method, or `auto`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyMethod {
    /// The fastest method that passed its self-check.
    #[default]
    Auto,
    /// `cuMemcpyBatchAsync`.
    Batch,
    /// The gather/scatter kernel.
    Kernel,
    /// One copy per run.
    PerRun,
}

/// What the self-check found for one method.
#[derive(Clone, Debug, PartialEq)]
pub enum Check {
    /// Bytes compared equal both ways; the measured speed of the check's timed batch.
    Passed {
        /// Bytes per second over both directions.
        bytes_per_sec: f64,
    },
    /// Unavailable here or wrong: why, for the log and the metric.
    Disabled {
        /// The reason, naming the symbol, driver error or first wrong byte.
        reason: String,
    },
}

/// The decision: which method runs, and why when it is not the one asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// The method copies use.
    pub method: Method,
    /// Set when the configured method was not usable: what was asked, and why it was not.
    pub fallback_from: Option<(Method, String)>,
}

impl CopyMethod {
    /// The configured method, or `None` for `auto`.
    pub fn named(self) -> Option<Method> {
        match self {
            CopyMethod::Auto => None,
            CopyMethod::Batch => Some(Method::Batch),
            CopyMethod::Kernel => Some(Method::Kernel),
            CopyMethod::PerRun => Some(Method::PerRun),
        }
    }

    /// The name used in config files.
    pub fn name(self) -> &'static str {
        self.named().map_or("auto", Method::name)
    }

    /// Picks the method from every method's self-check. `None` when none passed: the device
    /// cannot copy at all.
    ///
    /// A named method that passed is used even when another measured faster: the operator
    /// chose it. A named method that failed gives way to the fastest that passed.
    pub fn choose(self, checks: &[(Method, Check)]) -> Option<Choice> {
        let fastest = checks
            .iter()
            .filter_map(|(m, c)| match c {
                Check::Passed { bytes_per_sec } => Some((*m, *bytes_per_sec)),
                Check::Disabled { .. } => None,
            })
            // Ties (and NaN, which a broken clock could give) keep the earlier method, the
            // order of `Method::ALL`.
            .reduce(|best, m| if m.1 > best.1 { m } else { best })
            .map(|(m, _)| m)?;
        let Some(want) = self.named() else {
            return Some(Choice {
                method: fastest,
                fallback_from: None,
            });
        };
        match checks.iter().find(|(m, _)| *m == want) {
            Some((_, Check::Passed { .. })) => Some(Choice {
                method: want,
                fallback_from: None,
            }),
            Some((_, Check::Disabled { reason })) => Some(Choice {
                method: fastest,
                fallback_from: Some((want, reason.clone())),
            }),
            None => Some(Choice {
                method: fastest,
                fallback_from: Some((want, "not offered by this device".into())),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passed(gbps: f64) -> Check {
        Check::Passed {
            bytes_per_sec: gbps * 1e9,
        }
    }

    fn disabled(why: &str) -> Check {
        Check::Disabled { reason: why.into() }
    }

    #[test]
    fn auto_takes_the_fastest_method_that_passed() {
        let checks = [
            (Method::Batch, disabled("cuMemcpyBatchAsync missing")),
            (Method::Kernel, passed(40.0)),
            (Method::PerRun, passed(12.0)),
        ];
        let c = CopyMethod::Auto.choose(&checks).unwrap();
        assert_eq!(c.method, Method::Kernel);
        assert_eq!(c.fallback_from, None);
    }

    #[test]
    fn a_named_method_that_passed_is_used_even_when_slower() {
        let checks = [
            (Method::Batch, passed(50.0)),
            (Method::PerRun, passed(10.0)),
        ];
        let c = CopyMethod::PerRun.choose(&checks).unwrap();
        assert_eq!(c.method, Method::PerRun);
    }

    #[test]
    fn a_named_method_that_failed_gives_way_and_says_why() {
        let checks = [
            (Method::Batch, disabled("byte 17 differs")),
            (Method::PerRun, passed(10.0)),
        ];
        let c = CopyMethod::Batch.choose(&checks).unwrap();
        assert_eq!(c.method, Method::PerRun);
        assert_eq!(
            c.fallback_from,
            Some((Method::Batch, "byte 17 differs".into()))
        );
        let c = CopyMethod::Kernel.choose(&checks).unwrap();
        assert_eq!(c.fallback_from.unwrap().1, "not offered by this device");
    }

    #[test]
    fn nothing_passed_means_no_choice() {
        let checks = [(Method::PerRun, disabled("cuMemcpyAsync: invalid value"))];
        assert_eq!(CopyMethod::Auto.choose(&checks), None);
        assert_eq!(CopyMethod::PerRun.choose(&[]), None);
    }

    #[test]
    fn settings_spell_methods_in_snake_case_and_refuse_others() {
        #[derive(Deserialize)]
        struct S {
            m: CopyMethod,
        }
        for (text, m) in [
            ("auto", CopyMethod::Auto),
            ("batch", CopyMethod::Batch),
            ("kernel", CopyMethod::Kernel),
            ("per_run", CopyMethod::PerRun),
        ] {
            let s: S = serde_json_like(text);
            assert_eq!(s.m, m);
            assert_eq!(m.name(), text);
        }
        fn serde_json_like(v: &str) -> S {
            use serde::de::IntoDeserializer;
            use serde::de::value::{Error, MapDeserializer};
            let map = [("m", v)]
                .into_iter()
                .map(|(k, v)| (k, v.into_deserializer()));
            S::deserialize(MapDeserializer::<_, Error>::new(map)).unwrap()
        }
        use serde::de::IntoDeserializer;
        use serde::de::value::{Error, StrDeserializer};
        let d: StrDeserializer<'_, Error> = "fast".into_deserializer();
        let e = CopyMethod::deserialize(d).unwrap_err().to_string();
        assert!(e.contains("per_run") && e.contains("fast"), "{e}");
    }
}
