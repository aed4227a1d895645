//! Validation of one option's value against its [`OptionSpec`]: the range checks the store
//! shares, resolving a user's value (defaulted, normalised) and the refusal messages.

use serde_json::Value;

use super::schema::DRAM_LOW_WATERMARK;
use super::spec::{Kind, OptionSpec, TextRule};
use crate::address;
use crate::sizes::HugepageSize;
use crate::CoreError;

/// Why a value was refused (becomes the message of a [`CoreError::InvalidOption`]).
type Refusal = String;

impl OptionSpec {
    /// The error for `value`: names the option, says what it must be and what it got.
    pub(super) fn refuse(&self, why: Refusal) -> CoreError {
        CoreError::option(self.name, why)
    }

    fn must_be(&self, value: &Value) -> CoreError {
        self.refuse(format!("must be {}, got {value}", self.expected()))
    }

    /// Checks one integer against the option's range (the store's arguments use this too).
    pub fn check_u64(&self, n: u64) -> Result<u64, CoreError> {
        match self.kind {
            Kind::Int { min, max, .. } if n < min || n > max => Err(self.must_be(&Value::from(n))),
            _ => Ok(n),
        }
    }

    /// Checks one fraction (the store's watermarks use this too).
    pub fn check_f64(&self, f: f64) -> Result<f64, CoreError> {
        if f > 0.0 && f <= 1.0 {
            Ok(f)
        } else {
            Err(self.refuse(format!("must be {}, got {f}", self.expected())))
        }
    }

    /// The value of this option from the user's `value` (None: not given), defaulted and
    /// resolved (`null` for an unset optional value).
    pub fn resolve(&self, value: Option<&Value>) -> Result<Value, CoreError> {
        let v = match value {
            None => return Ok(self.default_json()),
            Some(Value::Null) if self.nullable => return Ok(self.default_json()),
            Some(v) => v,
        };
        match self.kind {
            Kind::Bool => v.as_bool().map(Value::Bool).ok_or_else(|| self.must_be(v)),
            Kind::Int { .. } => match v.as_u64() {
                Some(n) => self.check_u64(n).map(Value::from),
                None => Err(self.must_be(v)),
            },
            Kind::Fraction => match v.as_f64() {
                Some(f) => self.check_f64(f).map(|_| v.clone()),
                None => Err(self.must_be(v)),
            },
            Kind::Choice(choices) => match v.as_str() {
                Some(s) if choices.contains(&s) => Ok(v.clone()),
                _ => Err(self.must_be(v)),
            },
            Kind::Priority => v.as_i64().map(Value::from).ok_or_else(|| self.must_be(v)),
            Kind::HugepageSize => {
                let text = match v {
                    Value::String(s) => s.clone(),
                    Value::Number(n) if n.is_u64() => n.to_string(),
                    _ => return Err(self.must_be(v)),
                };
                let size: HugepageSize = text.parse()?;
                Ok(Value::from(size.to_string()))
            }
            Kind::Text(rule) => {
                let Some(s) = v.as_str() else {
                    return Err(self.refuse(format!("must be a string, got {v}")));
                };
                check_text(rule, s).map_err(|why| self.refuse(why))
            }
        }
    }
}

fn check_text(rule: TextRule, s: &str) -> Result<Value, Refusal> {
    let has_space = s.chars().any(char::is_whitespace);
    match rule {
        TextRule::Namespace if s == "auto" => Ok(Value::Null),
        TextRule::Namespace if s.is_empty() || s.contains(':') || has_space => Err(format!(
            "must be non-empty, without ':' or whitespace, got {s:?}; pick another namespace \
             or leave it unset to derive it"
        )),
        TextRule::Instance if s.contains('/') || has_space => {
            Err(format!("must not contain '/' or whitespace, got {s:?}"))
        }
        TextRule::Directory if !std::path::Path::new(s).is_dir() => Err(format!(
            "{s:?} is not an existing directory; create it or pick another"
        )),
        TextRule::Endpoint => address::socket_path(s)
            .map(Value::from)
            .map_err(|e| e.to_string()),
        TextRule::RemoteUrl => {
            let scheme = s.split_once("://").map(|(a, _)| a.to_ascii_lowercase());
            match scheme.as_deref() {
                Some(
                    "redis" | "redis+cluster" | "valkey" | "valkey+cluster" | "rediss"
                    | "rediss+cluster" | "valkeys" | "valkeys+cluster",
                ) if !has_space => Ok(Value::from(s)),
                _ => Err(format!(
                    "must be redis://host:port (one server) or \
                     redis+cluster://host:port,host:port (a cluster), rediss:// for TLS, got {:?}",
                    address::redact_url(s)
                )),
            }
        }
        _ => Ok(Value::from(s)),
    }
}

/// Checks that the low watermark is below the high one (the store checks its own with this).
pub fn check_watermarks(high: f64, low: f64) -> Result<(), CoreError> {
    if low >= high {
        return Err(DRAM_LOW_WATERMARK.refuse(format!(
            "{low} must be below `dram_high_watermark` ({high}); lower it or raise the high \
             watermark"
        )));
    }
    Ok(())
}
