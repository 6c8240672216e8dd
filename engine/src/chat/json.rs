//! An order-preserving JSON value and Python-compatible serialization.
//!
//! The official DeepSeek-V4 encoder renders tool schemas and tool-call arguments with Python's
//! `json.dumps(value, ensure_ascii=False)`: keys in document order, separators `", "` and `": "`, non-ASCII kept,
//! floats written as Python's `repr`. `serde_json::Value` sorts keys, so the chat code keeps JSON in [`JsonValue`]
//! (objects are `Vec<(key, value)>`) and writes it with [`JsonValue::to_python_json`].
//!
//! Parsing goes through serde (`serde_json::from_str::<JsonValue>`), whose visitor sees object entries in document
//! order. A repeated key keeps its first position and takes the last value, as a Python `dict` does. Integers beyond
//! 64 bits become floats (Python would keep them exact); `NaN`/`Infinity` are rejected (serde_json does).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// A JSON value whose objects keep their key order.
#[derive(Clone, Debug, PartialEq)]
pub enum JsonValue {
    Null,
    Bool(bool),
    /// An integer (JSON numbers without fraction or exponent that fit in i64/u64).
    Int(i128),
    Float(f64),
    String(String),
    Array(Vec<JsonValue>),
    Object(Vec<(String, JsonValue)>),
}

impl JsonValue {
    /// Parses JSON text.
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The value of `key` in an object.
    pub fn get(&self, key: &str) -> Option<&JsonValue> {
        match self {
            JsonValue::Object(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            JsonValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Python's `json.dumps(self, ensure_ascii=False)`.
    pub fn to_python_json(&self) -> String {
        let mut out = String::new();
        self.write_python(&mut out);
        out
    }

    fn write_python(&self, out: &mut String) {
        match self {
            JsonValue::Null => out.push_str("null"),
            JsonValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            JsonValue::Int(i) => out.push_str(&i.to_string()),
            JsonValue::Float(f) => out.push_str(&python_float_repr(*f)),
            JsonValue::String(s) => push_python_string(out, s),
            JsonValue::Array(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.write_python(out);
                }
                out.push(']');
            }
            JsonValue::Object(kv) => {
                out.push('{');
                for (i, (k, v)) in kv.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    push_python_string(out, k);
                    out.push_str(": ");
                    v.write_python(out);
                }
                out.push('}');
            }
        }
    }
}

/// Appends `s` as a Python `json.dumps(s, ensure_ascii=False)` string literal (with quotes).
pub fn push_python_string(out: &mut String, s: &str) {
    out.push('"');
    push_python_string_body(out, s);
    out.push('"');
}

/// Appends the escaped body of a JSON string literal (no quotes). Escaping is per character, so escaping a text in
/// pieces gives the same result as escaping it whole.
pub fn push_python_string_body(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

/// Python's `repr(float)` for finite values (`1.0`, `0.0001`, `1e-05`, `1e+16`, `1.5e+300`); `NaN`, `Infinity` and
/// `-Infinity` as `json.dumps` writes them.
pub fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "1.2345e-5", "-3e16".
    let e = format!("{:e}", f.abs());
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let n = digits.len() as i32;
    let decpt = exp + 1; // value = 0.DIGITS × 10^decpt
    let mut out = String::new();
    if f < 0.0 {
        out.push('-');
    }
    if !(-4 < decpt && decpt <= 16) {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.abs()));
    } else if decpt <= 0 {
        out.push_str("0.");
        out.push_str(&"0".repeat((-decpt) as usize));
        out.push_str(&digits);
    } else if decpt >= n {
        out.push_str(&digits);
        out.push_str(&"0".repeat((decpt - n) as usize));
        out.push_str(".0");
    } else {
        out.push_str(&digits[..decpt as usize]);
        out.push('.');
        out.push_str(&digits[decpt as usize..]);
    }
    out
}

impl<'de> Deserialize<'de> for JsonValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = JsonValue;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<JsonValue, E> {
        Ok(JsonValue::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<JsonValue, E> {
        Ok(JsonValue::Int(v as i128))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<JsonValue, E> {
        Ok(JsonValue::Int(v as i128))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<JsonValue, E> {
        Ok(JsonValue::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<JsonValue, E> {
        Ok(JsonValue::String(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<JsonValue, E> {
        Ok(JsonValue::String(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<JsonValue, E> {
        Ok(JsonValue::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<JsonValue, E> {
        Ok(JsonValue::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<JsonValue, D::Error> {
        JsonValue::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<JsonValue, A::Error> {
        let mut v = Vec::new();
        while let Some(x) = seq.next_element()? {
            v.push(x);
        }
        Ok(JsonValue::Array(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonValue, A::Error> {
        let mut kv: Vec<(String, JsonValue)> = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, JsonValue>()? {
            match kv.iter_mut().find(|(key, _)| *key == k) {
                Some(slot) => slot.1 = v,
                None => kv.push((k, v)),
            }
        }
        Ok(JsonValue::Object(kv))
    }
}

impl Serialize for JsonValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            JsonValue::Null => s.serialize_unit(),
            JsonValue::Bool(b) => s.serialize_bool(*b),
            JsonValue::Int(i) => match i64::try_from(*i) {
                Ok(v) => s.serialize_i64(v),
                Err(_) => match u64::try_from(*i) {
                    Ok(v) => s.serialize_u64(v),
                    Err(_) => s.serialize_f64(*i as f64),
                },
            },
            JsonValue::Float(f) => s.serialize_f64(*f),
            JsonValue::String(x) => s.serialize_str(x),
            JsonValue::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for it in items {
                    seq.serialize_element(it)?;
                }
                seq.end()
            }
            JsonValue::Object(kv) => {
                let mut m = s.serialize_map(Some(kv.len()))?;
                for (k, v) in kv {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_dumps_format() {
        let v = JsonValue::parse(r#"{"z": 1, "a": [true, null, "x\"y\n\u0001é"], "m": {"k": -2}}"#).unwrap();
        assert_eq!(v.to_python_json(), r#"{"z": 1, "a": [true, null, "x\"y\n\u0001é"], "m": {"k": -2}}"#);
        let v = JsonValue::parse(r#"{"a": 1, "b": 2, "a": 3}"#).unwrap();
        assert_eq!(v.to_python_json(), r#"{"a": 3, "b": 2}"#);
        assert_eq!(JsonValue::parse("[]").unwrap().to_python_json(), "[]");
        assert_eq!(JsonValue::parse("{}").unwrap().to_python_json(), "{}");
        assert!(JsonValue::parse("{").is_err());
    }

    #[test]
    fn float_repr_matches_python() {
        // Expected values are Python 3's repr() of the same floats.
        for (f, s) in [
            (1.0, "1.0"),
            (1.5, "1.5"),
            (-0.25, "-0.25"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789.125, "123456789.125"),
            (1.5e300, "1.5e+300"),
            (0.1 + 0.2, "0.30000000000000004"),
            (2.5e-7, "2.5e-07"),
            (-0.0, "-0.0"),
            (12345678901234567890.0, "1.2345678901234567e+19"),
        ] {
            assert_eq!(python_float_repr(f), s, "{f}");
        }
        assert_eq!(JsonValue::parse("1E2").unwrap().to_python_json(), "100.0");
        assert_eq!(JsonValue::parse("-7").unwrap().to_python_json(), "-7");
    }

    #[test]
    fn serde_round_trip_keeps_order() {
        let v = JsonValue::parse(r#"{"b": 1, "a": {"d": 2.5, "c": "x"}}"#).unwrap();
        let text = serde_json::to_string(&v).unwrap();
        assert_eq!(text, r#"{"b":1,"a":{"d":2.5,"c":"x"}}"#);
    }
}
