//! `assets/demo-model.gguf`: the small trained demo model (`tools/train_demo`, DeepSeek-V4 architecture with one MTP
//! block, byte-level tokenizer with the chat template's special tokens). Checks that the engine loads it, that a
//! rendered chat prompt tokenizes into byte tokens plus one token per chat marker, that the MTP block is in the file,
//! and that greedy chat output reads as text (letters and spaces), not noise.

use std::path::Path;

use ds4_engine::chat::{render, Message, Mode, ReasoningEffort, RenderInput, Role};
use ds4_engine::gguf::GgufFile;
use ds4_engine::tokenizer::{Tokenizer, ASSISTANT_TOKEN, BOS_TOKEN, THINK_END_TOKEN, THINK_START_TOKEN, USER_TOKEN};
use ds4_engine::{Engine, EngineOptions};

fn asset() -> GgufFile {
    GgufFile::open(Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/demo-model.gguf")).unwrap()
}

fn chat_prompt(user: &str, mode: Mode) -> String {
    render(&RenderInput { messages: vec![Message::new(Role::User, user)] }, mode, ReasoningEffort::High).unwrap()
}

#[test]
fn chat_prompts_tokenize_into_bytes_and_chat_markers() {
    let f = asset();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let one = |s: &str| {
        let ids = tok.encode(s).unwrap();
        assert_eq!(ids.len(), 1, "{s} is one token");
        ids[0]
    };
    let (bos, user, asst, think, think_end) =
        (one(BOS_TOKEN), one(USER_TOKEN), one(ASSISTANT_TOKEN), one(THINK_START_TOKEN), one(THINK_END_TOKEN));
    assert_eq!((bos, tok.bos(), tok.eos()), (0, 0, 1));
    for (mode, last) in [(Mode::Chat, think_end), (Mode::Thinking, think)] {
        let text = "Hello, wörld 12";
        let prompt = chat_prompt(text, mode);
        let ids = tok.encode(&prompt).unwrap();
        let mut want = vec![bos, user];
        // Byte b is token 3 + b (after BOS, EOS and PAD).
        want.extend(text.bytes().map(|b| 3 + b as u32));
        want.extend([asst, last]);
        assert_eq!(ids, want, "{prompt:?}");
        assert_eq!(tok.decode(&ids).unwrap(), prompt);
    }
}

#[test]
fn the_demo_model_has_its_mtp_block_and_answers_in_words() {
    let f = asset();
    assert_eq!(f.get_usize("deepseek4.nextn_predict_layers").unwrap(), 1);
    let n_mtp = f.tensors().iter().filter(|t| t.name.starts_with("mtp.0.")).count();
    assert!(n_mtp >= 30, "{n_mtp} mtp.0.* tensors");
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let mut e = Engine::from_gguf(f, EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
    let ids = tok.encode(&chat_prompt("What does the function join do?", Mode::Chat)).unwrap();
    let s = e.create_session();
    e.feed(s, &ids).unwrap();
    e.run_until_idle().unwrap();
    let mut out = Vec::new();
    for _ in 0..60 {
        let l = e.logits(s).unwrap();
        let id = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap() as u32;
        if id == tok.eos() {
            break;
        }
        out.push(id);
        e.feed(s, &[id]).unwrap();
        e.run_until_idle().unwrap();
    }
    let text = tok.decode(&out).unwrap();
    eprintln!("greedy answer: {text:?}");
    let wordy = text.chars().filter(|c| c.is_ascii_alphabetic() || *c == ' ').count();
    assert!(text.len() >= 20 && wordy * 10 >= text.chars().count() * 7, "not text: {text:?}");
    assert!(text.split(' ').filter(|w| w.len() >= 3 && w.chars().all(|c| c.is_ascii_lowercase())).count() >= 3);
}
