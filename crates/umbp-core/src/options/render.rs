//! An option's default and its documentation texts: the default as a JSON value or a typed
//! constant, and the words the docs' tables and the refusals use for the default, the
//! accepted values and the rejected ones.

use serde_json::{Number, Value};

use super::spec::{DefaultValue, Kind, OptionSpec, TextRule, Unit};
use crate::sizes::{GIB, MIB};

/// A size in bytes as the docs write it: `64 GiB`, `1 MiB`, else the number.
pub fn bytes_text(n: u64) -> String {
    if n >= GIB && n.is_multiple_of(GIB) {
        format!("{} GiB", n / GIB)
    } else if n >= MIB && n.is_multiple_of(MIB) {
        format!("{} MiB", n / MIB)
    } else {
        n.to_string()
    }
}

impl OptionSpec {
    /// The default as a JSON value (`null` when unset).
    pub fn default_json(&self) -> Value {
        match self.default {
            DefaultValue::Bool(b) => Value::Bool(b),
            DefaultValue::Int(n) => Value::from(n),
            DefaultValue::Float(f) => Number::from_f64(f).map_or(Value::Null, Value::Number),
            DefaultValue::Str(s) => Value::from(s),
            DefaultValue::Unset => Value::Null,
        }
    }

    /// The default of a boolean option.
    ///
    /// # Panics
    /// If the option is not a boolean (a bug the schema's tests catch).
    pub fn default_bool(&self) -> bool {
        match self.default {
            DefaultValue::Bool(b) => b,
            _ => panic!("option `{}` has no boolean default", self.name),
        }
    }

    /// The default of an integer option.
    ///
    /// # Panics
    /// If the option has no integer default.
    pub fn default_u64(&self) -> u64 {
        match self.default {
            DefaultValue::Int(n) => n,
            _ => panic!("option `{}` has no integer default", self.name),
        }
    }

    /// The default of a fraction.
    ///
    /// # Panics
    /// If the option has no numeric default.
    pub fn default_f64(&self) -> f64 {
        match self.default {
            DefaultValue::Float(f) => f,
            _ => panic!("option `{}` has no numeric default", self.name),
        }
    }

    /// The default of a string option.
    ///
    /// # Panics
    /// If the option has no string default.
    pub fn default_str(&self) -> &'static str {
        match self.default {
            DefaultValue::Str(s) => s,
            _ => panic!("option `{}` has no string default", self.name),
        }
    }

    /// The default as the docs show it (Markdown).
    pub fn default_text(&self) -> String {
        if let Some(d) = self.default_doc {
            return d.to_owned();
        }
        match (self.default, self.kind) {
            (
                DefaultValue::Int(n),
                Kind::Int {
                    unit: Unit::Bytes, ..
                },
            ) => bytes_text(n),
            (DefaultValue::Int(n), _) => n.to_string(),
            (DefaultValue::Bool(b), _) => b.to_string(),
            (DefaultValue::Float(f), _) => f.to_string(),
            (DefaultValue::Str(s), _) => format!("`\"{s}\"`"),
            (DefaultValue::Unset, _) => "—".to_owned(),
        }
    }

    /// The type and range in words (the start of every refusal of a value of the wrong type or
    /// out of range), e.g. `an integer in 1..=256`.
    pub fn expected(&self) -> String {
        match self.kind {
            Kind::Bool => "true or false".to_owned(),
            Kind::Int { min, max, unit } => {
                let fmt = |n: u64| match unit {
                    Unit::Bytes if n >= MIB => format!("{n} ({})", bytes_text(n)),
                    _ => n.to_string(),
                };
                if max == u64::MAX {
                    format!("an integer >= {}", fmt(min))
                } else {
                    format!("an integer in {}..={}", fmt(min), fmt(max))
                }
            }
            Kind::Fraction => "a number in (0, 1] (a fraction of capacity, such as 0.9)".to_owned(),
            Kind::Choice(c) => {
                let quoted: Vec<String> = c.iter().map(|s| format!("{s:?}")).collect();
                format!("one of {}", quoted.join(", "))
            }
            Kind::Text(TextRule::Namespace) => {
                "a non-empty string without ':' or whitespace".to_owned()
            }
            Kind::Text(TextRule::Instance) => "a string without '/' or whitespace".to_owned(),
            Kind::Text(TextRule::Directory) => "the path of an existing directory".to_owned(),
            Kind::Text(TextRule::Endpoint) => {
                "an absolute socket path or unix:///absolute/path".to_owned()
            }
            Kind::Text(TextRule::RemoteUrl) => {
                "a redis://, redis+cluster://, rediss:// or rediss+cluster:// URL".to_owned()
            }
            Kind::HugepageSize => "\"2MiB\" or \"1GiB\"".to_owned(),
            Kind::Priority => {
                "an integer (a vLLM request priority; lower is served first)".to_owned()
            }
        }
    }

    /// The docs' "Rejected when" text (Markdown).
    pub fn rejected_text(&self) -> String {
        let base = match self.kind {
            Kind::Bool => "Not a boolean.".to_owned(),
            Kind::Int { min, max, unit } => {
                let fmt = |n: u64| match unit {
                    Unit::Bytes => bytes_text(n),
                    _ => n.to_string(),
                };
                // A node number's u32 bound is no range a user picks: not shown.
                if max == u64::MAX || max == u64::from(u32::MAX) {
                    format!("Not an integer ≥ {}.", fmt(min))
                } else {
                    format!("Not an integer in {}–{}.", fmt(min), fmt(max))
                }
            }
            Kind::Fraction => "Outside (0, 1].".to_owned(),
            Kind::Choice(_) => "Any other value.".to_owned(),
            Kind::Text(TextRule::Namespace) => {
                "Not a string, empty, or contains `:` or whitespace.".to_owned()
            }
            Kind::Text(TextRule::Instance) => {
                "Not a string, or contains `/` or whitespace.".to_owned()
            }
            Kind::Text(TextRule::Directory) => "Not an existing directory.".to_owned(),
            Kind::Text(TextRule::Endpoint) => {
                "A TCP address, a relative path, a directory, a path longer than 103 bytes, or \
                 not a string."
                    .to_owned()
            }
            Kind::Text(TextRule::RemoteUrl) => {
                "Not a `redis://`, `redis+cluster://`, `rediss://` or `rediss+cluster://` URL."
                    .to_owned()
            }
            Kind::Priority => "Not an integer.".to_owned(),
            Kind::HugepageSize => {
                "Not `\"2MiB\"` or `\"1GiB\"` (also accepted: `2M`, `1G`, `2097152`, ...)."
                    .to_owned()
            }
        };
        match self.also_rejected {
            Some(more) => format!("{base} {more}"),
            None => base,
        }
    }
}
