//! The types an option is described by: its scope, the kind and range of its value, its
//! default, and the [`OptionSpec`] that holds them with its documentation.

use serde::{Deserialize, Serialize};

/// Which mode an option belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Accepted in every mode.
    Shared,
    /// Embedded mode only (rejected in standalone mode: the server owns the pool).
    Embedded,
    /// Standalone mode only.
    Standalone,
}

impl Scope {
    /// The scope's name as the docs and the schema binding spell it.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Shared => "shared",
            Scope::Embedded => "embedded",
            Scope::Standalone => "standalone",
        }
    }
}

/// What an integer counts, for messages and documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// A plain count (threads, objects, blocks, a node number).
    Count,
    /// Bytes (shown as MiB / GiB where exact).
    Bytes,
    /// Milliseconds.
    Millis,
    /// Seconds.
    Seconds,
}

/// String options with a rule of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextRule {
    /// A key namespace: non-empty, no `:` or whitespace; `"auto"` means derived (unset).
    Namespace,
    /// A lookup instance: no `/` or whitespace (it becomes part of socket names).
    Instance,
    /// An existing directory.
    Directory,
    /// A Unix socket: an absolute path or a `unix://` address (resolved to the path).
    Endpoint,
    /// A Redis / Valkey URL (`redis://`, `redis+cluster://`; checked fully when the store
    /// starts).
    RemoteUrl,
}

/// The type and range of an option's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// `true` or `false`.
    Bool,
    /// An integer in `min..=max` (`max` is `u64::MAX` for no upper bound).
    Int {
        /// Smallest value accepted.
        min: u64,
        /// Largest value accepted.
        max: u64,
        /// What it counts.
        unit: Unit,
    },
    /// A fraction of the pool's capacity, in (0, 1].
    Fraction,
    /// One of a few strings.
    Choice(&'static [&'static str]),
    /// A string with a rule.
    Text(TextRule),
    /// A huge page size (see [`HugepageSize`]'s spellings), resolved to `"2MiB"` or `"1GiB"`.
    HugepageSize,
    /// A vLLM request priority: any integer, negative too (lower is served first).
    Priority,
}

/// An option's default value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DefaultValue {
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(u64),
    /// A number.
    Float(f64),
    /// A string.
    Str(&'static str),
    /// No value: derived at run time, optional or required (see `default_doc`).
    Unset,
}

/// One option of the connector: everything about it lives here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionSpec {
    /// The option's name in `kv_connector_extra_config`.
    pub name: &'static str,
    /// The modes that accept it.
    pub scope: Scope,
    /// Its type and range.
    pub kind: Kind,
    /// Its default.
    pub default: DefaultValue,
    /// Whether `null` is accepted (meaning: unset, i.e. the default).
    pub nullable: bool,
    /// How the docs show the default when the value alone does not say it.
    pub default_doc: Option<&'static str>,
    /// What it does (Markdown, the docs table's "Meaning" column).
    pub doc: &'static str,
    /// Rejections beyond the type and range (Markdown, appended to the "Rejected when" column).
    pub also_rejected: Option<&'static str>,
}
