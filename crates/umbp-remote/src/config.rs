//! What shapes a remote tier: the write policy, the URL and other settings
//! ([`RemoteConfig`]), their validation against the connector's option ranges, and the
//! shared secret file that switches values from a checksum to a keyed MAC.

use std::path::{Path, PathBuf};
use std::time::Duration;

use umbp_core::options;

use crate::conn::Target;
use crate::error::RemoteError;
use crate::object;

/// When objects are written to the remote store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WritePolicy {
    /// Every object, as soon as it is committed to the pool.
    #[default]
    Eager,
    /// An object the second time a lookup hits it in the pool (hits of one key less than a
    /// second apart count once: vLLM looks a waiting request up again every step).
    OnReuse,
    /// Never: the tier only reads what other nodes (or other ranks) wrote. The vLLM connector
    /// gives it to the ranks of an MLA replica group but the first, whose objects they share.
    Never,
}

impl WritePolicy {
    /// Parses `eager`, `on_reuse` or `never`.
    pub fn parse(s: &str) -> Result<WritePolicy, RemoteError> {
        match s {
            "eager" => Ok(WritePolicy::Eager),
            "on_reuse" => Ok(WritePolicy::OnReuse),
            "never" => Ok(WritePolicy::Never),
            other => Err(RemoteError::Setting {
                name: "remote_write",
                why: format!("{other:?} is not \"eager\", \"on_reuse\" or \"never\""),
            }),
        }
    }

    /// The policy's name as options spell it.
    pub fn name(self) -> &'static str {
        match self {
            WritePolicy::Eager => "eager",
            WritePolicy::OnReuse => "on_reuse",
            WritePolicy::Never => "never",
        }
    }
}

/// Everything that shapes a remote tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteConfig {
    /// `redis://host:port`, or `redis+cluster://host:port,host:port` (user and password as in
    /// `redis://user:password@host:port`).
    pub url: String,
    /// Expiry of written objects (`None`: kept until the remote store evicts them).
    pub ttl: Option<Duration>,
    /// When objects are written.
    pub write: WritePolicy,
    /// How long a lookup waits for the remote store, and how long each connect and each
    /// answer may take.
    pub timeout: Duration,
    /// Bytes of objects waiting to be written; beyond it new objects are dropped (counted).
    pub write_backlog_bytes: u64,
    /// Write rate limit in bytes per second (0: none).
    pub write_bytes_per_s: u64,
    /// A file holding a secret the nodes share (at least 16 bytes; a final newline is not
    /// part of it): values are then sealed with a keyed MAC (HMAC-SHA256) instead of a
    /// checksum, and only values sealed with the same secret are taken ([`object`]).
    /// [`RemoteConfig::new`] takes it from `UMBP_REMOTE_SECRET_FILE`.
    pub secret_file: Option<PathBuf>,
}

/// The environment variable naming the remote tier's secret file.
pub const SECRET_FILE_ENV: &str = "UMBP_REMOTE_SECRET_FILE";

/// The secret file `UMBP_REMOTE_SECRET_FILE` names, if set and not empty.
pub fn secret_file_from_env() -> Option<PathBuf> {
    std::env::var_os(SECRET_FILE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Reads the secret of `path` into a MAC key; errors name the file and what to change. Warns
/// when other users may read the file.
pub(crate) fn read_secret(path: &Path) -> Result<object::MacKey, RemoteError> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |why: String| RemoteError::Setting {
        name: "remote secret file",
        why: format!("{}: {why}", path.display()),
    };
    let bytes = std::fs::read(path).map_err(|e| {
        bad(format!(
            "cannot read it ({e}); name a file this user can read"
        ))
    })?;
    let secret = bytes
        .strip_suffix(b"\r\n")
        .or_else(|| bytes.strip_suffix(b"\n"))
        .unwrap_or(&bytes);
    let key = object::MacKey::new(secret).map_err(bad)?;
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            log::warn!(
                "remote tier: the secret file {} is readable by other users (mode {:o}); \
                 chmod 600 it",
                path.display(),
                m.permissions().mode() & 0o777
            );
        }
    }
    Ok(key)
}

impl RemoteConfig {
    /// A configuration with the defaults for everything but the URL.
    pub fn new(url: impl Into<String>) -> RemoteConfig {
        RemoteConfig {
            url: url.into(),
            ttl: Some(options::REMOTE_TTL_S.default_u64())
                .filter(|&s| s > 0)
                .map(Duration::from_secs),
            write: WritePolicy::parse(options::REMOTE_WRITE.default_str())
                .expect("the schema's remote_write default is a policy"),
            timeout: Duration::from_millis(options::REMOTE_TIMEOUT_MS.default_u64()),
            write_backlog_bytes: options::REMOTE_WRITE_BACKLOG.default_u64(),
            write_bytes_per_s: options::REMOTE_WRITE_MB_PER_S
                .default_u64()
                .saturating_mul(1_000_000),
            secret_file: secret_file_from_env(),
        }
    }

    /// Checks every setting (the ranges of the connector's options); parses the URL.
    pub fn validate(&self) -> Result<Target, RemoteError> {
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        for (spec, v) in [
            (&options::REMOTE_TIMEOUT_MS, ms),
            (&options::REMOTE_WRITE_BACKLOG, self.write_backlog_bytes),
        ] {
            spec.check_u64(v).map_err(|e| RemoteError::Setting {
                name: spec.name,
                why: e.to_string(),
            })?;
        }
        Target::parse(&self.url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_write_policy_the_schema_offers_parses_and_names_itself() {
        for &name in options::REMOTE_WRITES {
            assert_eq!(WritePolicy::parse(name).unwrap().name(), name);
        }
        let e = WritePolicy::parse("lazy").unwrap_err().to_string();
        assert!(e.contains("remote_write") && e.contains("never"), "{e}");
    }
}
