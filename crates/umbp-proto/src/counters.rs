//! Groups of counters on the wire: a `map<string, uint64>` by field name, rendered from and
//! read into the group's struct by its model ([`umbp_core::counters`]), so no counter is
//! named in the protocol or its conversions.

use std::collections::HashMap;

use umbp_core::CounterSet;

/// `stats`' fields by name, for a `counters` map of the wire.
pub fn to_wire<S: CounterSet>(stats: &S) -> HashMap<String, u64> {
    stats.pairs().map(|(f, v)| (f.name.to_owned(), v)).collect()
}

/// The group a peer sent: names it does not know are skipped (a newer peer's counters),
/// fields it did not send read as 0 (an older peer's).
pub fn from_wire<S: CounterSet>(counters: &HashMap<String, u64>) -> S {
    S::from_pairs(counters.iter().map(|(k, v)| (k.as_str(), *v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    umbp_core::counter_set! {
        /// A test group.
        pub struct T: "t" {
            /// One.
            counter a: u64,
            /// Two.
            flag b: bool,
        }
    }

    #[test]
    fn a_group_survives_the_wire() {
        let t = T { a: 5, b: true };
        let w = to_wire(&t);
        assert_eq!(w.len(), 2);
        assert_eq!(from_wire::<T>(&w), t);
    }
}
