//! Tiny random checkpoints for tests and tools: a Llama-architecture GGUF with F32 weights and
//! a byte-level BPE vocabulary (the 256 byte tokens, a few merges, ChatML control tokens).

use super::gguf::MetaValue;
use super::gguf_writer::TensorOut;

/// Shape of a tiny Llama.
#[derive(Debug, Clone)]
pub struct TinyLlama {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub context: usize,
    pub seed: u64,
}

impl Default for TinyLlama {
    fn default() -> Self {
        TinyLlama {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            context: 64,
            seed: 1,
        }
    }
}

/// GPT-2's reversible byte-to-character map used by byte-level BPE vocabularies.
pub fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("valid code point")
}

const MERGES: &[(&str, &str)] = &[("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "t"), ("o", "r")];
pub const SPECIALS: &[&str] = &["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The vocabulary: specials first (ids 0..3), then the 256 byte tokens, then merged tokens.
pub fn vocab() -> Vec<String> {
    let mut v: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    v.extend((0..=255u8).map(|b| byte_to_char(b).to_string()));
    v.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    v
}

/// The tiny checkpoints' weight generator (an LCG; the committed fixtures depend on its exact
/// sequence).
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(crate) fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

impl TinyLlama {
    /// Metadata and tensors of the checkpoint, ready for [`super::gguf_writer::write`] (tests
    /// may edit them first to build broken files).
    pub fn build(&self) -> (Vec<(String, MetaValue)>, Vec<TensorOut>) {
        let vocab = vocab();
        let nv = vocab.len();
        let hd = self.hidden / self.heads;
        let s = |x: &str| MetaValue::Str(x.into());
        let u = |x: usize| MetaValue::U32(x as u32);
        let meta = vec![
            ("general.architecture".into(), s("llama")),
            ("general.name".into(), s("tiny-llama")),
            ("llama.block_count".into(), u(self.layers)),
            ("llama.context_length".into(), u(self.context)),
            ("llama.embedding_length".into(), u(self.hidden)),
            ("llama.feed_forward_length".into(), u(self.ffn)),
            ("llama.attention.head_count".into(), u(self.heads)),
            ("llama.attention.head_count_kv".into(), u(self.kv_heads)),
            ("llama.rope.freq_base".into(), MetaValue::F32(10000.0)),
            ("llama.attention.layer_norm_rms_epsilon".into(), MetaValue::F32(1e-5)),
            ("tokenizer.ggml.model".into(), s("gpt2")),
            ("tokenizer.ggml.pre".into(), s("smollm")),
            ("tokenizer.ggml.tokens".into(), MetaValue::Array(vocab.iter().map(|t| s(t)).collect())),
            (
                "tokenizer.ggml.token_type".into(),
                MetaValue::Array((0..nv).map(|i| MetaValue::I32(if i < SPECIALS.len() { 3 } else { 1 })).collect()),
            ),
            (
                "tokenizer.ggml.merges".into(),
                MetaValue::Array(MERGES.iter().map(|(a, b)| s(&format!("{a} {b}"))).collect()),
            ),
            ("tokenizer.ggml.bos_token_id".into(), u(1)),
            ("tokenizer.ggml.eos_token_id".into(), u(2)),
            (
                "tokenizer.chat_template".into(),
                s("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
            ),
        ];
        let mut r = Rng(self.seed);
        let (d, f) = (self.hidden, self.ffn);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let w = |r: &mut Rng, name: &str, rows: usize, cols: usize| {
            TensorOut::f32(
                name,
                &[rows, cols],
                &r.fill(rows * cols, 1.0 / (cols as f32).sqrt()),
            )
        };
        let ones = |name: &str, n: usize| TensorOut::f32(name, &[n], &vec![1.0; n]);
        let mut t = vec![
            w(&mut r, "token_embd.weight", nv, d),
            ones("output_norm.weight", d),
        ];
        for l in 0..self.layers {
            let p = |x: &str| format!("blk.{l}.{x}.weight");
            t.push(ones(&p("attn_norm"), d));
            t.push(w(&mut r, &p("attn_q"), q, d));
            t.push(w(&mut r, &p("attn_k"), kv, d));
            t.push(w(&mut r, &p("attn_v"), kv, d));
            t.push(w(&mut r, &p("attn_output"), d, q));
            t.push(ones(&p("ffn_norm"), d));
            t.push(w(&mut r, &p("ffn_gate"), f, d));
            t.push(w(&mut r, &p("ffn_up"), f, d));
            t.push(w(&mut r, &p("ffn_down"), d, f));
        }
        (meta, t)
    }
}
