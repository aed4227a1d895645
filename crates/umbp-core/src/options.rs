//! The vLLM connector's options (`kv_connector_extra_config`): one schema that owns every
//! option's default, range, documentation and error messages.
//!
//! The connector hands the user's options over as JSON; [`ConnectorOptions::from_json`] checks
//! them against [`SCHEMA`] and returns the typed, defaulted [`ConnectorOptions`]. Every error
//! is a [`CoreError::InvalidOption`] (or [`CoreError::UnknownOption`]) naming the option and
//! saying what to change. The store's own arguments ([`crate::PoolConfig`] and the store's
//! configuration) take their defaults and ranges from the same [`OptionSpec`]s, and
//! `docs/configuration.md`'s option tables are generated from [`SCHEMA`].
//!
//! The schema's types are in `spec`, the table of options in `schema`, the defaults and doc
//! texts in `render`, the checks of one value in `check` and [`ConnectorOptions`] in
//! `connector`.

mod check;
mod connector;
mod render;
mod schema;
mod spec;

pub use check::check_watermarks;
pub use connector::{ConnectorOptions, KvRole, Mode};
pub use render::bytes_text;
pub use schema::*;
pub use spec::{DefaultValue, Kind, OptionSpec, Scope, TextRule, Unit};

#[cfg(test)]
mod tests;
