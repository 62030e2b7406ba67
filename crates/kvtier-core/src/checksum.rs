//! CRC32C (Castagnoli), the checksum of every stored page, crash record and slot-table entry.
//!
//! One home for it, so every writer and reader agrees on the bits. The implementation is
//! `crc-fast`, which picks at run time the widest carry-less-multiply path the CPU has
//! (VPCLMULQDQ with AVX-512, PCLMULQDQ, ARM PMULL) and falls back to a table: about twice the
//! speed of the SSE4.2 `crc32` instruction on this project's machine (64 vs 32 GiB/s on a
//! cached 2 MiB page), which matters because a verified L3 read checksums every byte it
//! copies. The values are standard CRC32C, identical to what earlier versions wrote.

use crc_fast::{CrcAlgorithm, Digest};

/// CRC32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// CRC32C of the bytes `crc` covered followed by `bytes`: `crc32c_append(crc32c(a), b)` is
/// `crc32c(a ++ b)`.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(bytes);
    d.finalize() as u32
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    /// The check value of the catalogue and the test vectors of RFC 3720 (iSCSI), B.4.
    #[test]
    fn standard_vectors() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&inc), 0x46DD_794E);
        let dec: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&dec), 0x113F_DB5C);
        assert_eq!(crc32c(&[]), 0);
        assert_eq!(crc32c_append(0, &[]), 0);
    }

    proptest! {
        /// Appending in any pieces gives the checksum of the whole, at every length (the wide
        /// paths switch on at 16, 64, 256 bytes and more).
        #[test]
        fn append_in_pieces_equals_whole(
            data in proptest::collection::vec(any::<u8>(), 0..5000),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
        ) {
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(data.len() + 1)).collect();
            at.sort_unstable();
            let mut crc = 0;
            let mut from = 0;
            for to in at.into_iter().chain([data.len()]) {
                crc = crc32c_append(crc, &data[from..to]);
                from = to;
            }
            prop_assert_eq!(crc, crc32c(&data));
        }
    }
}
