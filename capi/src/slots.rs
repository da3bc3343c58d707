//! [`Slots`]: a table of live values behind generation-checked handles.
//!
//! A handle is `generation << 32 | (slot + 1)`, never 0. Removing a value empties its slot and
//! bumps the slot's generation, so a stale or forged handle finds nothing instead of reaching
//! whatever took the slot later.

/// A handle as C sees it (cast to an opaque pointer type).
pub type Handle = u64;

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// Live values by handle; reuses emptied slots.
pub struct Slots<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> std::fmt::Debug for Slots<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots")
            .field("live", &self.values().count())
            .finish_non_exhaustive()
    }
}

fn split(handle: Handle) -> Option<(usize, u32)> {
    let index = (handle & 0xFFFF_FFFF).checked_sub(1)?;
    Some((index as usize, (handle >> 32) as u32))
}

impl<T> Slots<T> {
    /// An empty table.
    pub const fn new() -> Self {
        Slots {
            slots: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Stores `value`; returns its new handle, or `None` when every slot id is taken.
    pub fn insert(&mut self, value: T) -> Option<Handle> {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(self.slots.len())
                    .ok()
                    .filter(|i| *i < u32::MAX)?;
                self.slots.push(Slot {
                    generation: 0,
                    value: None,
                });
                i
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.value = Some(value);
        Some((u64::from(slot.generation) << 32) | (u64::from(index) + 1))
    }

    /// The value behind `handle`, if it is live.
    pub fn get(&self, handle: Handle) -> Option<&T> {
        let (i, generation) = split(handle)?;
        self.slots
            .get(i)
            .filter(|s| s.generation == generation)?
            .value
            .as_ref()
    }

    /// Takes the value behind `handle`; the handle is dead from now on.
    pub fn remove(&mut self, handle: Handle) -> Option<T> {
        let (i, generation) = split(handle)?;
        let slot = self
            .slots
            .get_mut(i)
            .filter(|s| s.generation == generation && s.value.is_some())?;
        slot.generation = slot.generation.wrapping_add(1);
        let value = slot.value.take();
        self.free.push(i as u32);
        value
    }

    /// The live values.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.value.as_ref())
    }
}
