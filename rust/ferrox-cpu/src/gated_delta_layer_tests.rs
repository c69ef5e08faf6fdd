use super::*;
use crate::decoder_layer::LinearWeight;

struct Rand(u64);

impl Rand {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.next()).collect()
    }
}

/// Shapes and float32 parameters of a small layer (no MLP).
struct Layer {
    hidden: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    kernel: usize,
    tiled: bool,
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    qkv: Vec<f32>,
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
    conv: Vec<f32>,
    dt_bias: Vec<f32>,
    decay_scale: Vec<f32>,
    norm: Vec<f32>,
    out: Vec<f32>,
}

impl Layer {
    #[allow(clippy::too_many_arguments)]
    fn new(
        rand: &mut Rand,
        hidden: usize,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        tiled: bool,
        kernel: usize,
    ) -> Self {
        let channels = 2 * hk * dk + hv * dv;
        Self {
            hidden,
            hk,
            hv,
            dk,
            dv,
            kernel,
            tiled,
            input_norm: rand.vec(hidden).iter().map(|x| 1.0 + x).collect(),
            post_norm: rand.vec(hidden).iter().map(|x| 1.0 + x).collect(),
            qkv: rand.vec(channels * hidden),
            z: rand.vec(hv * dv * hidden),
            b: rand.vec(hv * hidden),
            a: rand.vec(hv * hidden),
            conv: rand.vec(channels * kernel),
            dt_bias: rand.vec(hv),
            decay_scale: rand.vec(hv).iter().map(|x| -(x + 0.6)).collect(),
            norm: rand.vec(dv).iter().map(|x| 1.0 + x).collect(),
            out: rand.vec(hidden * hv * dv),
        }
    }

    fn channels(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }

    fn weights(&self) -> GatedDeltaLayerWeights<'_> {
        fn linear(w: &[f32], n: usize) -> LayerLinear<'_> {
            LayerLinear {
                weight: LinearWeight::F32(w),
                bias: None,
                out_features: n,
            }
        }
        let value_dim = self.hv * self.dv;
        GatedDeltaLayerWeights {
            input_norm: &self.input_norm,
            post_attention_norm: &self.post_norm,
            eps: 1e-6,
            qkv: linear(&self.qkv, self.channels()),
            z: linear(&self.z, value_dim),
            b: linear(&self.b, self.hv),
            a: linear(&self.a, self.hv),
            conv: &self.conv,
            dt_bias: &self.dt_bias,
            decay_scale: &self.decay_scale,
            norm: &self.norm,
            out: linear(&self.out, self.hidden),
            mlp: None,
            activation: Gate::Silu,
            key_heads: self.hk,
            value_heads: self.hv,
            k_dim: self.dk,
            v_dim: self.dv,
            tiled: self.tiled,
        }
    }

    /// The layer as its definition reads, in f64, for one row: updates the
    /// row's convolution inputs and state; returns (residual, x) after it.
    fn reference(
        &self,
        residual: &[f32],
        x: &[f32],
        history: &mut [f64],
        s: &mut [f64],
    ) -> (Vec<f64>, Vec<f64>) {
        let (hk, hv, dk, dv) = (self.hk, self.hv, self.dk, self.dv);
        let rms = |v: &[f64], w: &[f32]| -> Vec<f64> {
            let inv = 1.0 / (v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64 + 1e-6).sqrt();
            v.iter().zip(w).map(|(a, &b)| a * inv * b as f64).collect()
        };
        let matvec = |w: &[f32], v: &[f64]| -> Vec<f64> {
            w.chunks_exact(v.len())
                .map(|row| row.iter().zip(v).map(|(&a, b)| a as f64 * b).sum())
                .collect()
        };
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        let stream: Vec<f64> = residual
            .iter()
            .zip(x)
            .map(|(&a, &b)| (a + b) as f64)
            .collect();
        let normed = rms(&stream, &self.input_norm);
        let mut qkv = matvec(&self.qkv, &normed);
        let z = matvec(&self.z, &normed);
        let (b, a) = (matvec(&self.b, &normed), matvec(&self.a, &normed));
        let keep = self.kernel - 1;
        for (c, value) in qkv.iter_mut().enumerate() {
            let past = &mut history[c * keep..(c + 1) * keep];
            let w = &self.conv[c * self.kernel..(c + 1) * self.kernel];
            let acc: f64 = past.iter().zip(w).map(|(p, &w)| p * w as f64).sum::<f64>()
                + *value * w[keep] as f64;
            past.rotate_left(1);
            past[keep - 1] = *value;
            *value = acc * sig(acc);
        }
        let unit = |v: &[f64], scale: f64| -> Vec<f64> {
            let inv = scale / (v.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
            v.iter().map(|a| a * inv).collect()
        };
        let mut o = vec![0.0; hv * dv];
        for head in 0..hv {
            let kh = if self.tiled {
                head % hk
            } else {
                head / (hv / hk)
            };
            let q = unit(&qkv[kh * dk..(kh + 1) * dk], (dk as f64).powf(-0.5));
            let k = unit(&qkv[(hk + kh) * dk..(hk + kh + 1) * dk], 1.0);
            let v = &qkv[2 * hk * dk + head * dv..2 * hk * dk + (head + 1) * dv];
            let softplus = (1.0 + (a[head] + self.dt_bias[head] as f64).exp()).ln();
            let decay = (self.decay_scale[head] as f64 * softplus).exp();
            let beta = sig(b[head]);
            let s = &mut s[head * dk * dv..(head + 1) * dk * dv];
            s.iter_mut().for_each(|x| *x *= decay);
            for j in 0..dv {
                let recall: f64 = (0..dk).map(|i| s[i * dv + j] * k[i]).sum();
                let delta = (v[j] - recall) * beta;
                (0..dk).for_each(|i| s[i * dv + j] += k[i] * delta);
                o[head * dv + j] = (0..dk).map(|i| s[i * dv + j] * q[i]).sum();
            }
            let out = &mut o[head * dv..(head + 1) * dv];
            let norm: Vec<f64> = rms(out, &self.norm);
            for (j, value) in out.iter_mut().enumerate() {
                let gate = z[head * dv + j];
                *value = norm[j] * gate * sig(gate);
            }
        }
        let mixed = matvec(&self.out, &o);
        let after: Vec<f64> = stream.iter().zip(&mixed).map(|(a, b)| a + b).collect();
        let x = rms(&after, &self.post_norm);
        (after, x)
    }
}

#[test]
fn decode_steps_match_the_layer_as_defined() {
    let mut rand = Rand(11);
    // (the models' convolution width, 4, and another, which the layer runs
    // through a loop of its own)
    for &(hk, hv, dk, dv, tiled, kernel) in &[
        (1, 1, 4, 4, false, 4),
        (2, 6, 8, 5, true, 4),
        (2, 4, 16, 8, false, 4),
        (2, 4, 8, 8, false, 3),
    ] {
        let layer = Layer::new(&mut rand, 24, hk, hv, dk, dv, tiled, kernel);
        let (slots, num_slots) = ([2i64, 0], 3);
        let held = layer.channels() * (layer.kernel - 1);
        let per_slot = hv * dk * dv;
        let mut conv_states = rand.vec(num_slots * held);
        let mut states = rand.vec(num_slots * per_slot);
        let mut want_history: Vec<Vec<f64>> = slots
            .iter()
            .map(|&s| {
                conv_states[s as usize * held..(s as usize + 1) * held]
                    .iter()
                    .map(|&v| v as f64)
                    .collect()
            })
            .collect();
        let mut want_state: Vec<Vec<f64>> = slots
            .iter()
            .map(|&s| {
                states[s as usize * per_slot..(s as usize + 1) * per_slot]
                    .iter()
                    .map(|&v| v as f64)
                    .collect()
            })
            .collect();
        // The second row starts afresh on its first step (whatever its slot holds).
        want_history[1].fill(0.0);
        want_state[1].fill(0.0);
        for fresh in [[false, true], [false, false]] {
            let residual = rand.vec(2 * 24);
            let x = rand.vec(2 * 24);
            let (mut got_res, mut got_x) = (residual.clone(), x.clone());
            let step = GatedDeltaLayerStep {
                slots: &slots,
                fresh: &fresh,
                num_threads: 2,
            };
            gated_delta_layer(
                &layer.weights(),
                &step,
                &mut got_res,
                &mut got_x,
                &mut conv_states,
                &mut states,
            )
            .unwrap();
            for r in 0..2 {
                let (res, out) = layer.reference(
                    &residual[r * 24..(r + 1) * 24],
                    &x[r * 24..(r + 1) * 24],
                    &mut want_history[r],
                    &mut want_state[r],
                );
                for (got, want) in got_res[r * 24..]
                    .iter()
                    .zip(&res)
                    .chain(got_x[r * 24..].iter().zip(&out))
                {
                    assert!(
                        (*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{got} vs {want}"
                    );
                }
                let slot = slots[r] as usize;
                for (got, want) in conv_states[slot * held..(slot + 1) * held]
                    .iter()
                    .zip(&want_history[r])
                    .chain(
                        states[slot * per_slot..(slot + 1) * per_slot]
                            .iter()
                            .zip(&want_state[r]),
                    )
                {
                    assert!((*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()));
                }
            }
        }
    }
}

#[test]
fn a_refused_step_leaves_the_pool_as_it_was() {
    let mut rand = Rand(5);
    let layer = Layer::new(&mut rand, 16, 1, 2, 4, 4, false, 4);
    let held = layer.channels() * (layer.kernel - 1);
    let mut conv_states = rand.vec(2 * held);
    let mut states = rand.vec(2 * 2 * 16);
    let (conv_before, before) = (conv_states.clone(), states.clone());
    let run = |slots: &[i64], conv_states: &mut [f32], states: &mut [f32]| {
        let (mut res, mut x) = (vec![0.5; slots.len() * 16], vec![0.5; slots.len() * 16]);
        let fresh = vec![false; slots.len()];
        let step = GatedDeltaLayerStep {
            slots,
            fresh: &fresh,
            num_threads: 1,
        };
        gated_delta_layer(
            &layer.weights(),
            &step,
            &mut res,
            &mut x,
            conv_states,
            states,
        )
    };
    for slots in [&[0i64, 0][..], &[1, 2], &[-1]] {
        let err = run(slots, &mut conv_states, &mut states).unwrap_err();
        assert!(
            err.0.contains("out of range or given to two rows"),
            "{err:?}"
        );
    }
    let err = run(&[0], &mut conv_states[..held], &mut states).unwrap_err();
    assert!(err.0.contains("same slots"), "{err:?}");
    assert_eq!((conv_states, states), (conv_before, before));
}

/// A bfloat16 pool runs the step on the values it holds as a float32 pool
/// of the same values does: the same outputs, bit for bit, and the states
/// it leaves are the float32 pool's rounded to bfloat16.
#[test]
fn a_bfloat16_pool_rounds_only_the_states_it_stores() {
    use crate::gated_delta::Bf16;
    let mut rand = Rand(23);
    // (value heads of 128: the width the step keeps in registers)
    let layer = Layer::new(&mut rand, 24, 2, 4, 16, 128, false, 4);
    let held = layer.channels() * (layer.kernel - 1);
    let per_slot = 4 * 16 * 128;
    let (slots, fresh) = ([1i64, 2, 0], [false, true, false]);
    let conv_before = rand.vec(3 * held);
    let half: Vec<Bf16> = rand
        .vec(3 * per_slot)
        .into_iter()
        .map(Bf16::store)
        .collect();
    let wide: Vec<f32> = half.iter().map(|s| s.load()).collect();
    let residual = rand.vec(3 * 24);
    let x = rand.vec(3 * 24);
    let step = GatedDeltaLayerStep {
        slots: &slots,
        fresh: &fresh,
        num_threads: 2,
    };
    let (mut half_states, mut wide_states) = (half.clone(), wide.clone());
    let inputs = (&residual, &x, &conv_before);
    let got = run_once(&layer, &step, inputs, &mut half_states);
    let want = run_once(&layer, &step, inputs, &mut wide_states);
    assert_eq!(got, want);
    let rounded: Vec<Bf16> = wide_states.iter().map(|&s| Bf16::store(s)).collect();
    assert_eq!(half_states, rounded);
    assert_ne!(half_states, half); // the step wrote them
}

/// The layer once over copies of (residual, x, convolution states) and the
/// pool `states` of either element type: the three copies as it left them.
fn run_once<E: StateElement>(
    layer: &Layer,
    step: &GatedDeltaLayerStep<'_>,
    (residual, x, conv): (&Vec<f32>, &Vec<f32>, &Vec<f32>),
    states: &mut [E],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut residual, mut x, mut conv) = (residual.clone(), x.clone(), conv.clone());
    gated_delta_layer(
        &layer.weights(),
        step,
        &mut residual,
        &mut x,
        &mut conv,
        states,
    )
    .unwrap();
    (residual, x, conv)
}
