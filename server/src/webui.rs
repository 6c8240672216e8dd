//! The built-in web page (`GET /`): a chat on the server's own `/v1/chat/completions` (streamed) and a status view
//! polled from `GET /v1/status` ([`crate::status`]). The page is three static files under `src/webui/`, embedded in
//! the binary at compile time (no CDN, nothing fetched or built at run time); `--no-webui` turns the routes off
//! (404).
//!
//! The assets are served through the same request path as the API ([`crate::http::handle`]), so whatever checks
//! that path applies to requests (Host, Origin, API key) applies to the page too; the page sends the API key a user
//! types into it as `Authorization: Bearer`. Responses carry a strict Content-Security-Policy (only same-origin
//! scripts, styles and connections; no framing), `nosniff` and `no-referrer`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::Response;

use crate::api::errors::ApiError;
use crate::response::Body;

const INDEX_HTML: &str = include_str!("webui/index.html");
const APP_JS: &str = include_str!("webui/app.js");
const STYLE_CSS: &str = include_str!("webui/style.css");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page's asset paths (below `/webui/`) and their content types.
const ASSETS: &[(&str, &str, &str)] =
    &[("app.js", "text/javascript; charset=utf-8", APP_JS), ("style.css", "text/css; charset=utf-8", STYLE_CSS)];

fn asset_response(content_type: &'static str, text: &'static str) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())).boxed());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("content-security-policy", HeaderValue::from_static(CSP));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    r
}

/// `GET /`.
pub fn page() -> Response<Body> {
    asset_response("text/html; charset=utf-8", INDEX_HTML)
}

/// `GET /webui/{name}`.
pub fn asset(name: &str) -> Result<Response<Body>, ApiError> {
    ASSETS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|&(_, ct, text)| asset_response(ct, text))
        .ok_or_else(|| ApiError::not_found(format!("no such page asset: {name}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_references_only_embedded_assets() {
        // Every script and stylesheet the page loads is one this module serves (nothing from another origin).
        for (attr, ext) in [("src=\"", ".js\""), ("href=\"", ".css\"")] {
            for part in INDEX_HTML.split(attr).skip(1) {
                let url = &part[..part.find('"').unwrap()];
                if !url.ends_with(&ext[..ext.len() - 1]) {
                    continue;
                }
                let name = url.strip_prefix("/webui/").unwrap_or_else(|| panic!("{url} is not a /webui/ asset"));
                assert!(asset(name).is_ok(), "{url}");
            }
        }
        assert!(!INDEX_HTML.contains("http://") && !INDEX_HTML.contains("https://"));
        assert!(!APP_JS.contains("innerHTML"), "model text must go in as textContent");
        assert!(asset("../Cargo.toml").is_err());
    }
}
