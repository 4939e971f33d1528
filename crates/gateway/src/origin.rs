//! What a server without API keys checks so that web pages cannot use it through a visitor's
//! browser.
//!
//! - Cross-site requests: a page may POST to any address without asking the server first when
//!   the request is "simple" (a `text/plain` or form body, no custom header). Requests to the
//!   API routes must declare `content-type: application/json` (parameters such as `charset`
//!   allowed), which a browser sends cross-site only after a CORS preflight this server never
//!   approves; others get 415.
//! - DNS rebinding: a page on `evil.example` whose name is re-pointed at 127.0.0.1 reaches a
//!   local server as same-origin, with `Host: evil.example`. The host a request names must be
//!   a loopback name (`localhost`, `*.localhost`), an IP address (an address cannot be
//!   rebound), or a name in [`GatewayConfig::allowed_hosts`](super::GatewayConfig); others get
//!   403. `/health` is exempt (probes name the host as they like). The host is the `Host`
//!   header's, or the target's authority where the transport passes it
//!   ([`Gateway::admit_at`](super::Gateway)); a request naming none is not a browser's and
//!   passes (browsers send `Host` over HTTP/1.1, and speak HTTP/2 and HTTP/3 only over TLS,
//!   where a rebound name fails certificate verification).
//!
//! A server with API keys needs neither: a page cannot present a key it does not have.

use std::net::IpAddr;

use http::HeaderMap;
use http::header::CONTENT_TYPE;

use super::error::{ApiError, ApiErrorKind};

/// The host part of an authority (`name:port`, `[v6]:port`), without the port or brackets.
fn host_of(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// Whether a keyless server answers a request that names `authority` as its host.
fn host_allowed(authority: &str, allowed: &[String]) -> bool {
    let host = host_of(authority.trim());
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.parse::<IpAddr>().is_ok() {
        return true;
    }
    let lower = host.to_ascii_lowercase();
    lower == "localhost"
        || lower.ends_with(".localhost")
        || allowed
            .iter()
            .any(|a| host_of(a).eq_ignore_ascii_case(host))
}

/// Refuses (403 `permission_error`) a request whose host is not one a keyless server answers;
/// `None`: the request names no host (not a browser's), allowed.
pub(crate) fn check_host(authority: Option<&str>, allowed: &[String]) -> Result<(), ApiError> {
    match authority {
        Some(a) if !host_allowed(a, allowed) => Err(ApiError::new(
            ApiErrorKind::Permission,
            format!(
                "Host `{a}`: a server without API keys answers only loopback names \
                 (localhost, *.localhost) and IP addresses, against DNS rebinding; start it \
                 with `--allow-host {}` to accept this name, or give it API keys",
                host_of(a)
            ),
        )),
        _ => Ok(()),
    }
}

/// Refuses (415) a request body not declared as `application/json`.
pub(crate) fn check_json_body(headers: &HeaderMap) -> Result<(), ApiError> {
    let declared = headers.get(CONTENT_TYPE).map(|v| v.to_str().unwrap_or("?"));
    let media_type = declared.map(|v| v.split(';').next().unwrap_or("").trim());
    if media_type.is_some_and(|m| m.eq_ignore_ascii_case("application/json")) {
        return Ok(());
    }
    Err(ApiError::new(
        ApiErrorKind::UnsupportedMediaType,
        format!(
            "content-type: a server without API keys takes only `application/json` request \
             bodies (got {}), so that a web page cannot send one through a browser without \
             the browser asking first",
            declared.map_or_else(|| "none".to_owned(), |v| format!("`{v}`"))
        ),
    ))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn loopback_names_and_ip_addresses_pass_other_names_only_when_allowed() {
        let none: &[String] = &[];
        for ok in [
            "localhost",
            "LOCALHOST:8080",
            "localhost.",
            "chat.localhost:80",
            "127.0.0.1:8080",
            "10.1.2.3",
            "[::1]:8080",
            "[fe80::1]",
        ] {
            assert!(host_allowed(ok, none), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "",
        ] {
            assert!(!host_allowed(bad, none), "{bad:?}");
        }
        let allowed = ["Box.lan".to_owned()];
        assert!(host_allowed("box.lan:8080", &allowed));
        assert!(!host_allowed("other.lan", &allowed));
        assert_eq!(check_host(None, none), Ok(()));
        let e = check_host(Some("evil.example:8080"), none).unwrap_err();
        assert_eq!(e.kind, ApiErrorKind::Permission);
        assert!(
            e.message.contains("`--allow-host evil.example`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn only_json_bodies_pass() {
        let with = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_static(v));
            check_json_body(&h)
        };
        assert_eq!(with("application/json"), Ok(()));
        assert_eq!(with("Application/JSON; charset=utf-8"), Ok(()));
        for bad in [
            "text/plain",
            "text/plain; charset=application/json",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonp",
        ] {
            let e = with(bad).unwrap_err();
            assert_eq!(e.kind, ApiErrorKind::UnsupportedMediaType, "{bad}");
        }
        let e = check_json_body(&HeaderMap::new()).unwrap_err();
        assert!(e.message.contains("got none"), "{}", e.message);
    }
}
