//! Cross-crate tests of kvtier; the tests themselves are the `[[test]]` targets.
