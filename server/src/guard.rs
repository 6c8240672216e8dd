//! Who may drive the server: checks applied to every request before routing, against a browser on the same machine
//! (DNS rebinding, cross-site requests) and, optionally, anyone without the API key.
//!
//! In order ([`Access::check`]):
//! 1. **Host** (every path but `/health`): the name in the `Host` header (port ignored) must be an IP address, `localhost`
//!    (or `*.localhost`), the `--host` value or an `--allowed-host` name. A DNS-rebinding page reaches the server under
//!    its own domain name, so it is refused (403). A request without `Host` (HTTP/1.0) passes.
//! 2. **Origin**: a browser sends `Origin` on cross-site requests. It must be an `--cors-origin` (or `*` set), or the
//!    request's own `Host` (same origin, e.g. a page served from this address). Otherwise 403. Clients that are not
//!    browsers send no `Origin` and are not affected. Allowed CORS origins get `access-control-allow-origin`, and an
//!    `OPTIONS` preflight is answered 204; without `--cors-origin` a preflight is refused (403), so a browser never
//!    sends the real request.
//! 3. **API key** (every path but `/health` and the web page's static files, `GET /` and `/webui/*`), when `--api-key`
//!    is set: `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time; 401 otherwise.
//! 4. **Body type** on `POST`: `content-type` must be `application/json` (parameters allowed) — the types a page may send
//!    without a preflight (`text/plain`, forms) get 415 — and the body must not be compressed (`content-encoding` other
//!    than `identity`, a `transfer-encoding` other than `chunked`): 415.
//!
//! Errors are [`ApiError`]s, rendered by the caller in the API's JSON shape.

use std::net::IpAddr;

use hyper::header::{
    HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_ENCODING, CONTENT_TYPE, HOST, ORIGIN, TRANSFER_ENCODING,
};
use hyper::Method;

use crate::api::errors::ApiError;

/// The access policy (from the command line).
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Lower-case host names accepted besides IP addresses and localhost.
    hosts: Vec<String>,
    any_host: bool,
    /// Origins allowed by CORS, lower-case, without a trailing `/`.
    origins: Vec<String>,
    any_origin: bool,
    api_key: Option<String>,
}

/// What a request passing the checks needs on its response.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Passed {
    /// `access-control-allow-origin` value for an allowed cross-origin request.
    pub allow_origin: Option<String>,
}

fn normalise_origin(o: &str) -> String {
    o.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// The host name of a `Host` header value or an origin's authority, without port and brackets, lower case.
fn host_name(authority: &str) -> String {
    let a = authority.trim();
    let name = if let Some(rest) = a.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        match a.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => a,
        }
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

impl Access {
    /// `bind_host` is `--host`; `hosts` the `--allowed-host` names; `origins` the `--cors-origin` values.
    pub fn new(bind_host: &str, hosts: &[String], origins: &[String], api_key: Option<String>) -> Self {
        let mut h: Vec<String> = hosts.iter().map(|x| host_name(x)).collect();
        h.push(host_name(bind_host));
        Access {
            any_host: hosts.iter().any(|x| x.trim() == "*"),
            hosts: h,
            any_origin: origins.iter().any(|x| x.trim() == "*"),
            origins: origins.iter().map(|o| normalise_origin(o)).collect(),
            api_key: api_key.filter(|k| !k.is_empty()),
        }
    }

    /// Whether an API key is required.
    pub fn has_api_key(&self) -> bool {
        self.api_key.is_some()
    }

    fn host_allowed(&self, name: &str) -> bool {
        self.any_host
            || name.parse::<IpAddr>().is_ok()
            || name == "localhost"
            || name.ends_with(".localhost")
            || self.hosts.iter().any(|h| h == name)
    }

    fn key_ok(&self, headers: &HeaderMap) -> bool {
        let Some(key) = &self.api_key else { return true };
        let bearer = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().strip_prefix("Bearer ").or_else(|| v.trim().strip_prefix("bearer ")))
            .map(str::trim);
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
        [bearer, x_api_key].into_iter().flatten().any(|given| constant_time_eq(given.as_bytes(), key.as_bytes()))
    }

    /// The origin check: `Ok(Some(origin))` for an allowed cross-origin request, `Ok(None)` without one.
    fn origin(&self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        let Some(origin) = headers.get(ORIGIN) else { return Ok(None) };
        let origin = origin.to_str().map(normalise_origin).unwrap_or_default();
        if self.any_origin || self.origins.contains(&origin) {
            return Ok(Some(origin));
        }
        let authority = origin.split_once("://").map(|(_, a)| a).unwrap_or("");
        let host = headers.get(HOST).and_then(|v| v.to_str().ok()).map(|h| h.trim().to_ascii_lowercase());
        if !authority.is_empty() && host.as_deref() == Some(authority) {
            return Ok(None);
        }
        Err(ApiError::new(
            403,
            "cross-origin requests are not allowed; start the server with --cors-origin ORIGIN to allow a web page",
        ))
    }

    /// Runs checks 1–3 of the module doc on any request to `route` (the path without `/v1`).
    pub fn check(&self, method: &Method, route: &str, headers: &HeaderMap) -> Result<Passed, ApiError> {
        let exempt = route == "/health";
        if !exempt {
            if let Some(h) = headers.get(HOST) {
                let name = h.to_str().map(host_name).unwrap_or_default();
                if !self.host_allowed(&name) {
                    return Err(ApiError::new(
                        403,
                        "the Host header names a host this server does not answer to; add it with --allowed-host",
                    ));
                }
            }
        }
        let allow_origin = self.origin(headers)?;
        // The page's static files (`GET /`, `/webui/*`) hold no data and a browser cannot add a header when it loads
        // a page: they need no key (Host and Origin still apply); the page sends the key on its API calls.
        let static_page = *method == Method::GET && (route == "/" || route.starts_with("/webui/"));
        if !exempt && !static_page && *method != Method::OPTIONS && !self.key_ok(headers) {
            return Err(ApiError::unauthorized(
                "missing or invalid API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`",
            ));
        }
        Ok(Passed { allow_origin })
    }

    /// The headers of the 204 answer to an `OPTIONS` request that passed [`Access::check`].
    pub fn preflight(
        &self,
        passed: &Passed,
        headers: &HeaderMap,
    ) -> Result<Vec<(&'static str, HeaderValue)>, ApiError> {
        let origin = passed
            .allow_origin
            .as_deref()
            .and_then(|o| HeaderValue::from_str(o).ok())
            .ok_or_else(|| ApiError::new(403, "CORS preflight refused: no --cors-origin allows this origin"))?;
        let asked = headers.get("access-control-request-headers").cloned().unwrap_or(HeaderValue::from_static(
            "authorization, content-type, x-api-key, anthropic-version, anthropic-beta",
        ));
        Ok(vec![
            ("access-control-allow-origin", origin),
            ("access-control-allow-methods", HeaderValue::from_static("GET, POST, OPTIONS")),
            ("access-control-allow-headers", asked),
            ("access-control-max-age", HeaderValue::from_static("600")),
            ("vary", HeaderValue::from_static("origin")),
        ])
    }
}

/// Check 4 of the module doc, for a `POST` body.
pub fn check_body_headers(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if media != "application/json" {
        let shown =
            if ct.is_empty() { "none".to_string() } else { format!("`{}`", ct.chars().take(80).collect::<String>()) };
        return Err(ApiError::new(415, format!("content-type must be application/json (got {shown})")));
    }
    if let Some(enc) = headers.get(CONTENT_ENCODING) {
        let enc = enc.to_str().unwrap_or("?").trim().to_ascii_lowercase();
        if enc != "identity" {
            return Err(ApiError::new(415, "compressed request bodies (content-encoding) are not supported"));
        }
    }
    for te in headers.get_all(TRANSFER_ENCODING) {
        let te = te.to_str().unwrap_or("?");
        if te.split(',').map(|c| c.trim().to_ascii_lowercase()).any(|c| c != "chunked") {
            return Err(ApiError::new(415, "only `transfer-encoding: chunked` is supported (no compression)"));
        }
    }
    Ok(())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn host_names() {
        assert_eq!(host_name("127.0.0.1:8000"), "127.0.0.1");
        assert_eq!(host_name("[::1]:8000"), "::1");
        assert_eq!(host_name("LocalHost"), "localhost");
        assert_eq!(host_name("example.com.:80"), "example.com");
        let a = Access::new("0.0.0.0", &["box.lan".into()], &[], None);
        for ok in ["127.0.0.1:8000", "[::1]:1", "localhost", "app.localhost:3", "box.lan:8000", "10.1.2.3"] {
            assert!(a.check(&Method::GET, "/models", &headers(&[("host", ok)])).is_ok(), "{ok}");
        }
        for bad in ["evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.com"] {
            let e = a.check(&Method::GET, "/models", &headers(&[("host", bad)])).unwrap_err();
            assert_eq!(e.status, 403, "{bad}");
        }
        assert!(a.check(&Method::GET, "/health", &headers(&[("host", "evil.example")])).is_ok());
    }

    #[test]
    fn origins() {
        let a = Access::new("127.0.0.1", &[], &["http://localhost:3000".into()], None);
        let h = |o: &str| headers(&[("host", "127.0.0.1:8000"), ("origin", o)]);
        assert_eq!(a.check(&Method::POST, "/messages", &h("http://evil.example")).unwrap_err().status, 403);
        assert_eq!(a.check(&Method::POST, "/messages", &h("null")).unwrap_err().status, 403);
        assert_eq!(a.check(&Method::POST, "/messages", &h("http://127.0.0.1:8000")).unwrap().allow_origin, None);
        let p = a.check(&Method::POST, "/messages", &h("http://localhost:3000/")).unwrap();
        assert_eq!(p.allow_origin.as_deref(), Some("http://localhost:3000"));
    }

    #[test]
    fn api_key() {
        let a = Access::new("127.0.0.1", &[], &[], Some("s3cret".into()));
        let chk = |h: &[(&'static str, &str)]| a.check(&Method::POST, "/chat/completions", &headers(h));
        assert_eq!(chk(&[]).unwrap_err().status, 401);
        assert_eq!(chk(&[("authorization", "Bearer nope")]).unwrap_err().status, 401);
        assert_eq!(chk(&[("x-api-key", "s3cre")]).unwrap_err().status, 401);
        assert!(chk(&[("authorization", "Bearer s3cret")]).is_ok());
        assert!(chk(&[("x-api-key", "s3cret")]).is_ok());
        assert!(a.check(&Method::GET, "/health", &HeaderMap::new()).is_ok());
        // The page loads without the key, but its data does not.
        assert!(a.check(&Method::GET, "/", &HeaderMap::new()).is_ok());
        assert!(a.check(&Method::GET, "/webui/app.js", &HeaderMap::new()).is_ok());
        assert_eq!(a.check(&Method::GET, "/status", &HeaderMap::new()).unwrap_err().status, 401);
        assert_eq!(a.check(&Method::POST, "/", &HeaderMap::new()).unwrap_err().status, 401);
        // Host still applies to the page.
        assert_eq!(a.check(&Method::GET, "/", &headers(&[("host", "evil.example")])).unwrap_err().status, 403);
    }

    #[test]
    fn body_headers() {
        assert!(check_body_headers(&headers(&[("content-type", "application/json; charset=utf-8")])).is_ok());
        for bad in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""] {
            let h = if bad.is_empty() { HeaderMap::new() } else { headers(&[("content-type", bad)]) };
            assert_eq!(check_body_headers(&h).unwrap_err().status, 415, "{bad}");
        }
        let h = headers(&[("content-type", "application/json"), ("transfer-encoding", "gzip, chunked")]);
        assert_eq!(check_body_headers(&h).unwrap_err().status, 415);
        let h = headers(&[("content-type", "application/json"), ("content-encoding", "gzip")]);
        assert_eq!(check_body_headers(&h).unwrap_err().status, 415);
    }
}
