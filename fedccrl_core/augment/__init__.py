"""Feature augmentation, one module per algorithm of the papers, each reachable by its name:
  compose      FedCCRL's M = AugMix ∘ MixStyle (Eq. 3): `fedccrl_augment`
  settings     M's settings, declared once without torch (`AugmentParams`, train.fedccrl's augmentation keys)
  ccdt         CCDT / MixStyle from the statistics pool (Alg. 2)
  augmix       DIFP / per-sample AugMix on the device (Alg. 3)
  augmix_ops   its operation set O and one chain step over a batch (Alg. 3 lines 7-9)
  augmix_batch the reference code's batch AugMix (torchvision's, one op chain per batch)
  augmix_pil   the same per-sample AugMix with PIL on the host
  adain        AdaIN style transfer for CCST


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""
