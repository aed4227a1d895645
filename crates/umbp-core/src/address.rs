//! How addresses are written: the standalone server's endpoint (a Unix socket) and the remote
//! tier's URL as messages and logs may show it.
//!
//! One parser of endpoints ([`socket_path`]) serves the connector's `endpoint` option, the
//! server's `--address`, the clients and the command-line tools (`umbp_proto::Endpoint` wraps
//! it); one function ([`redact_url`]) hides a URL's password wherever a URL is shown.

use crate::CoreError;

/// The endpoint the server listens on and the tools connect to when none is given.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/umbp/node.grpc.sock";

/// Longest socket path accepted: `sockaddr_un` holds 108 bytes with the terminating NUL, and
/// the descriptor side channel appends `.fds` to the path.
pub const MAX_SOCKET_PATH_BYTES: usize = 107 - ".fds".len();

/// The socket path of an endpoint: `unix:///abs/path`, `unix:/abs/path` or `/abs/path`
/// (surrounding whitespace ignored). TCP and other schemes, relative paths, directories and
/// paths too long for a Unix socket address are refused with [`CoreError::InvalidEndpoint`].
pub fn socket_path(endpoint: &str) -> Result<&str, CoreError> {
    let refuse = |why| CoreError::InvalidEndpoint {
        given: endpoint.to_owned(),
        why,
    };
    let t = endpoint.trim();
    if t.is_empty() {
        return Err(refuse("it is empty"));
    }
    let path = if let Some(rest) = t.strip_prefix("unix://") {
        rest
    } else if let Some(rest) = t.strip_prefix("unix:") {
        rest
    } else if t.contains("://") {
        return Err(refuse("only unix:// addresses are served (no TCP)"));
    } else {
        t
    };
    if path.is_empty() {
        return Err(refuse("it names no path"));
    }
    if !path.starts_with('/') {
        return Err(refuse("the socket path is relative"));
    }
    if path.ends_with('/') {
        return Err(refuse("the path names a directory"));
    }
    if path.len() > MAX_SOCKET_PATH_BYTES {
        return Err(refuse(
            "the path is longer than a Unix socket address allows (103 bytes)",
        ));
    }
    Ok(path)
}

/// `url` with the password between `://` and `@` replaced by `***` (the user name is kept),
/// for messages and logs. A URL without credentials is returned as it is.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let credentials = &url[scheme_end + 3..at];
            let user = credentials.split_once(':').map_or("", |(user, _)| user);
            let separator = if user.is_empty() { "" } else { ":" };
            format!(
                "{}://{user}{separator}***{}",
                &url[..scheme_end],
                &url[at..]
            )
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_absolute_unix_socket_paths() {
        for (given, path) in [
            (DEFAULT_ENDPOINT, "/run/umbp/node.grpc.sock"),
            ("/run/umbp/node.grpc.sock", "/run/umbp/node.grpc.sock"),
            ("unix:/r/s.sock", "/r/s.sock"),
            (" /r/s.sock\n", "/r/s.sock"),
        ] {
            assert_eq!(socket_path(given).unwrap(), path, "{given:?}");
        }
        for (given, why) in [
            ("", "empty"),
            ("tcp://127.0.0.1:5000", "no TCP"),
            ("http://h:1", "no TCP"),
            ("relative.sock", "relative"),
            ("unix://x.sock", "relative"),
            ("unix://", "no path"),
            ("/dir/", "directory"),
        ] {
            let e = socket_path(given).unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains("absolute socket path") && e.contains(given),
                "{given:?}: {e}"
            );
        }
        let longest = format!("/{}", "a".repeat(MAX_SOCKET_PATH_BYTES - 1));
        assert!(socket_path(&longest).is_ok());
        let e = socket_path(&format!("{longest}a")).unwrap_err().to_string();
        assert!(e.contains("longer"), "{e}");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact_url("redis://u:secret@h:1"), "redis://u:***@h:1");
        assert_eq!(redact_url("redis://:secret@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("redis://secret@h:1/0"), "redis://***@h:1/0");
        assert_eq!(
            redact_url("rediss+cluster://u:p@ss@a:1,b:2"),
            "rediss+cluster://u:***@a:1,b:2"
        );
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(redact_url("h@1"), "h@1");
    }
}
