//! A free-slot allocator for fixed-size slot pools (the L2 host pool, device page pools).
//!
//! Allocation and free are `O(1)`; a bitmap of allocated slots makes a double free or a free of
//! a slot that was never handed out an error instead of a silent corruption of the free list.
//! Freed slots are reused last-in first-out, so recently touched (cache-warm) memory is reused
//! first.

use crate::Error;

/// Hands out slot numbers `0..capacity`.
#[derive(Clone, Debug)]
pub struct SlotAllocator {
    free: Vec<u32>,
    allocated: Vec<u64>,
    capacity: u32,
}

impl SlotAllocator {
    /// An allocator with every one of `capacity` slots free.
    pub fn new(capacity: u32) -> Self {
        Self {
            free: (0..capacity).rev().collect(),
            allocated: vec![0; (capacity as usize).div_ceil(64)],
            capacity,
        }
    }

    /// Slots in the pool.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Slots handed out and not yet freed.
    pub fn in_use(&self) -> u32 {
        self.capacity - self.free.len() as u32
    }

    /// Slots free.
    pub fn available(&self) -> u32 {
        self.free.len() as u32
    }

    /// Whether `slot` is currently handed out.
    pub fn is_allocated(&self, slot: u32) -> bool {
        slot < self.capacity && self.allocated[(slot / 64) as usize] & (1 << (slot % 64)) != 0
    }

    /// A free slot, or `None` when every slot is in use.
    pub fn alloc(&mut self) -> Option<u32> {
        let slot = self.free.pop()?;
        self.allocated[(slot / 64) as usize] |= 1 << (slot % 64);
        Some(slot)
    }

    /// Returns `slot` to the pool. Freeing a slot that is not allocated is an error and changes
    /// nothing.
    pub fn free(&mut self, slot: u32) -> Result<(), Error> {
        if slot >= self.capacity {
            return Err(Error::InvalidField {
                field: "slot",
                reason: format!("{slot} is outside the pool of {} slots", self.capacity),
            });
        }
        if !self.is_allocated(slot) {
            return Err(Error::InvalidField {
                field: "slot",
                reason: format!("double free of slot {slot}"),
            });
        }
        self.allocated[(slot / 64) as usize] &= !(1 << (slot % 64));
        self.free.push(slot);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_every_slot_once_and_detects_double_free() {
        let mut a = SlotAllocator::new(130);
        let mut got: Vec<u32> = std::iter::from_fn(|| a.alloc()).collect();
        assert_eq!(got.len(), 130);
        got.sort_unstable();
        assert_eq!(got, (0..130).collect::<Vec<_>>());
        assert_eq!(a.available(), 0);
        a.free(129).unwrap();
        assert!(a.free(129).unwrap_err().to_string().contains("double free"));
        assert!(a.free(130).unwrap_err().to_string().contains("outside"));
        assert_eq!(a.alloc(), Some(129));
        assert_eq!(a.in_use(), 130);
        let mut empty = SlotAllocator::new(0);
        assert_eq!(empty.alloc(), None);
    }
}
