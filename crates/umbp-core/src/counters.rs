//! The one model of a group of counters: declared once with [`counter_set!`], every surface
//! (the wire, Python's dicts, Prometheus, `umbp stats`) is rendered from it.
//!
//! A group is a plain struct of `u64` (or `bool`) fields; the macro adds its [`CounterSet`]
//! description: the group's name, and per field its name, help text (the field's doc comment)
//! and kind (a [`Kind::Counter`] only grows, a [`Kind::Gauge`] is a reading, a
//! [`Kind::Flag`] is yes or no). Code that shows counters walks [`CounterSet::FIELDS`] and
//! [`CounterSet::values`], so a field added to the struct reaches every surface without being
//! named anywhere else; a field a surface cannot show (an old peer's wire) reads as 0.
//!
//! ```
//! umbp_core::counter_set! {
//!     /// What a small cache counts.
//!     pub struct CacheStats: "cache" {
//!         /// Lookups that found the object.
//!         counter hits: u64,
//!         /// Objects held now.
//!         gauge objects: u64,
//!         /// Whether the backing store answers.
//!         flag connected: bool,
//!     }
//! }
//! use umbp_core::counters::CounterSet;
//! let s = CacheStats { hits: 3, objects: 2, connected: true };
//! let wire: Vec<(String, u64)> = s.pairs().map(|(f, v)| (f.name.to_string(), v)).collect();
//! assert_eq!(CacheStats::from_pairs(wire.iter().map(|(n, v)| (n.as_str(), *v))), s);
//! assert_eq!(CacheStats::FIELDS[0].help(), "Lookups that found the object.");
//! ```

/// How a field's value behaves, which decides how Prometheus types it (and whether its name
/// gets `_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only grows while the process lives (`*_total` in Prometheus).
    Counter,
    /// A reading that goes up and down (bytes held, objects, a configured size).
    Gauge,
    /// Yes or no: 1 or 0 on the wire and in Prometheus, `True` / `False` in Python.
    Flag,
}

/// One field of a [`CounterSet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// The field's name: the struct field, the wire key, the Python key.
    pub name: &'static str,
    /// What it counts: the field's doc comment as the compiler gives it (a line each, with
    /// their leading spaces); [`help`](Self::help) joins it into one line.
    pub doc: &'static str,
    /// How it behaves.
    pub kind: Kind,
    /// Its Prometheus name within the group where that is not the field's name (kept from
    /// before the model, so dashboards go on working): `as "name"` in [`counter_set!`].
    pub series_name: Option<&'static str>,
}

impl Field {
    /// The help text: the doc comment's lines joined by single spaces.
    pub fn help(&self) -> String {
        self.doc
            .split('\n')
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The Prometheus series of this field in `group`: `umbp_<group>_<name>` (or its
    /// `series_name`), with `_total` for a counter.
    pub fn series(&self, group: &str) -> String {
        let name = self.series_name.unwrap_or(self.name);
        match self.kind {
            Kind::Counter => format!("umbp_{group}_{name}_total"),
            Kind::Gauge | Kind::Flag => format!("umbp_{group}_{name}"),
        }
    }
}

/// A value a counter field may hold.
pub trait CountValue: Copy {
    /// The value as a number (a flag as 1 or 0).
    fn count(self) -> u64;
    /// The value from a number (a flag: non-zero is yes).
    fn from_count(v: u64) -> Self;
}

impl CountValue for u64 {
    fn count(self) -> u64 {
        self
    }
    fn from_count(v: u64) -> Self {
        v
    }
}

impl CountValue for bool {
    fn count(self) -> u64 {
        u64::from(self)
    }
    fn from_count(v: u64) -> Self {
        v != 0
    }
}

/// A group of counters declared with [`counter_set!`].
pub trait CounterSet: Sized + Default {
    /// The group's name: the Prometheus prefix (`umbp_<group>_`) and the key of the group
    /// in a stats dict.
    const GROUP: &'static str;
    /// Every field, in declaration order.
    const FIELDS: &'static [Field];
    /// Every field's value, in the order of [`FIELDS`](Self::FIELDS).
    fn values(&self) -> Vec<u64>;
    /// Sets the field called `name`; false when the group has none (a newer peer's field).
    fn set(&mut self, name: &str, value: u64) -> bool;

    /// Each field with its value.
    fn pairs(&self) -> std::iter::Zip<std::slice::Iter<'static, Field>, std::vec::IntoIter<u64>> {
        Self::FIELDS.iter().zip(self.values())
    }

    /// The group from `(name, value)` pairs (the wire): names it does not know are skipped,
    /// fields no pair names stay 0.
    fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, u64)>) -> Self {
        let mut s = Self::default();
        for (name, v) in pairs {
            s.set(name, v);
        }
        s
    }

    /// The value of the field called `name`.
    fn get(&self, name: &str) -> Option<u64> {
        Self::FIELDS
            .iter()
            .position(|f| f.name == name)
            .map(|i| self.values()[i])
    }
}

/// Declares a group of counters: the struct (with `Debug, Clone, Copy, Default, PartialEq,
/// Eq`) and its [`CounterSet`](crate::counters::CounterSet). Each field is
/// `counter name: u64`, `gauge name: u64` or `flag name: bool`, after its doc comment (the
/// help text every surface shows), optionally followed by `as "series"`, its Prometheus name
/// where that differs. See the [module](crate::counters) for an example.
#[macro_export]
macro_rules! counter_set {
    (
        $(#[doc = $sdoc:literal])*
        $vis:vis struct $name:ident : $group:literal {
            $(
                $(#[doc = $doc:literal])+
                $kind:ident $field:ident : $ty:ty $(as $series:literal)?
            ),+ $(,)?
        }
    ) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        $vis struct $name {
            $(
                $(#[doc = $doc])+
                pub $field: $ty,
            )+
        }

        impl $crate::counters::CounterSet for $name {
            const GROUP: &'static str = $group;
            const FIELDS: &'static [$crate::counters::Field] = &[
                $(
                    $crate::counters::Field {
                        name: stringify!($field),
                        doc: concat!($($doc, "\n"),+),
                        kind: $crate::counters::kinds::$kind,
                        series_name: $crate::counters::series_name(&[$($series)?]),
                    },
                )+
            ];
            fn values(&self) -> Vec<u64> {
                vec![$($crate::counters::CountValue::count(self.$field)),+]
            }
            fn set(&mut self, name: &str, value: u64) -> bool {
                match name {
                    $(stringify!($field) => {
                        self.$field = $crate::counters::CountValue::from_count(value);
                        true
                    })+
                    _ => false,
                }
            }
        }
    };
}

/// The kinds by the words [`counter_set!`] takes (`counter`, `gauge`, `flag`).
#[doc(hidden)]
#[allow(non_upper_case_globals)]
pub mod kinds {
    use super::Kind;
    /// `counter`.
    pub const counter: Kind = Kind::Counter;
    /// `gauge`.
    pub const gauge: Kind = Kind::Gauge;
    /// `flag`.
    pub const flag: Kind = Kind::Flag;
}

/// A field's `as "series"`, if it has one (for [`counter_set!`]).
#[doc(hidden)]
pub const fn series_name(given: &[&'static str]) -> Option<&'static str> {
    match given {
        [s] => Some(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::counter_set! {
        /// A test group.
        pub struct Demo: "demo" {
            /// Things seen.
            /// Over two lines.
            counter seen: u64,
            /// Bytes held.
            gauge held_bytes: u64 as "bytes",
            /// Up or down.
            flag up: bool,
        }
    }

    #[test]
    fn fields_follow_the_declaration() {
        let names: Vec<_> = Demo::FIELDS.iter().map(|f| f.name).collect();
        assert_eq!(names, ["seen", "held_bytes", "up"]);
        assert_eq!(Demo::FIELDS[0].kind, Kind::Counter);
        assert_eq!(Demo::FIELDS[2].kind, Kind::Flag);
        assert_eq!(Demo::FIELDS[0].help(), "Things seen. Over two lines.");
        assert_eq!(Demo::FIELDS[0].series(Demo::GROUP), "umbp_demo_seen_total");
        assert_eq!(Demo::FIELDS[1].series(Demo::GROUP), "umbp_demo_bytes");
        assert_eq!(Demo::FIELDS[2].series(Demo::GROUP), "umbp_demo_up");
    }

    #[test]
    fn pairs_round_trip_and_unknown_names_are_skipped() {
        let d = Demo {
            seen: 7,
            held_bytes: 1 << 40,
            up: true,
        };
        assert_eq!(d.values(), vec![7, 1 << 40, 1]);
        let mut wire: Vec<(String, u64)> =
            d.pairs().map(|(f, v)| (f.name.to_string(), v)).collect();
        wire.push(("from_a_newer_peer".into(), 9));
        let back = Demo::from_pairs(wire.iter().map(|(n, v)| (n.as_str(), *v)));
        assert_eq!(back, d);
        assert_eq!(back.get("held_bytes"), Some(1 << 40));
        assert_eq!(back.get("nope"), None);
        // An older peer's wire, without a field: it reads as 0.
        let old = Demo::from_pairs([("seen", 3)]);
        assert_eq!(
            old,
            Demo {
                seen: 3,
                ..Demo::default()
            }
        );
    }
}
