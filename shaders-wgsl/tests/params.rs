//! The Rust parameter blocks (`ds4_shaders_wgsl::params`) against naga's reflection of each shader's `Params`
//! struct: same size, and every named member at the same offset with the same size (padding members, `_…`, may be
//! spelled differently on the two sides as long as the layout agrees).

use ds4_shaders_wgsl::params::{self, ParamsLayout};

/// `(name, byte offset, byte size)` of each member.
type Members = Vec<(String, u32, u32)>;

/// The members of the shader's `Params` struct, and its size.
fn reflect(src: &str) -> Result<(Members, u32), String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).map_err(|e| format!("layout: {e:?}"))?;
    let (handle, ty) =
        module.types.iter().find(|(_, t)| t.name.as_deref() == Some("Params")).ok_or("no `Params` struct")?;
    let naga::TypeInner::Struct { members, span } = &ty.inner else {
        return Err("`Params` is not a struct".into());
    };
    assert_eq!(layouter[handle].size, *span);
    let members = members.iter().map(|m| (m.name.clone().unwrap_or_default(), m.offset, layouter[m.ty].size)).collect();
    Ok((members, *span))
}

fn check(p: &ParamsLayout) -> Result<(), String> {
    let (wgsl, span) = reflect(p.source)?;
    if span as usize != p.size {
        return Err(format!("size: WGSL {span} bytes, Rust {}", p.size));
    }
    for (name, off, size) in wgsl.iter().filter(|m| !m.0.starts_with('_')) {
        match p.members.iter().find(|m| m.0 == name) {
            Some(&(_, o, s)) if (o, s) == (*off as usize, *size as usize) => {}
            Some(&(_, o, s)) => {
                return Err(format!("`{name}`: WGSL offset {off} size {size}, Rust offset {o} size {s}"))
            }
            None => return Err(format!("`{name}` is in the shader but not in the Rust struct")),
        }
    }
    for (name, ..) in p.members.iter().filter(|m| !m.0.starts_with('_')) {
        if !wgsl.iter().any(|m| m.0 == *name) {
            return Err(format!("`{name}` is in the Rust struct but not in the shader"));
        }
    }
    Ok(())
}

#[test]
fn every_params_block_matches_its_shader() {
    let all = params::all();
    assert_eq!(all.len(), 17);
    let errors: Vec<String> =
        all.iter().filter_map(|p| check(p).err().map(|e| format!("{}: {e}", p.rust_name))).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn a_mismatch_is_caught() {
    let mut p = params::all().into_iter().find(|p| p.rust_name == "NormParams").unwrap();
    // A member moved, a member missing, a wrong size: each is reported.
    p.members[1].1 += 4;
    assert!(check(&p).unwrap_err().contains("rows"));
    p.members.remove(1);
    assert!(check(&p).unwrap_err().contains("rows"));
    p.size += 16;
    assert!(check(&p).unwrap_err().contains("size"));
}
