# A minimal deployment: one job on a SPOT GPU VM, images in a new bucket. See docs/deploy-gcp.md.
terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 5.20.0, < 7.0.0"
    }
    tls = {
      source  = "hashicorp/tls"
      version = ">= 4.0.0, < 5.0.0"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}

module "spotguard" {
  source = "../../modules/spotguard"

  project_id     = var.project_id
  region         = var.region
  name           = "spotguard-demo"
  image          = var.image
  machine_type   = "g2-standard-8"
  controller_url = var.controller_url
  job_tokens     = var.job_tokens
  controller_tls = var.controller_tls

  jobs = {
    "train-llm" = {
      command = "cd /opt/train && exec python3 train.py --resume-from-env"
    }
  }

  labels = {
    project = "spotguard-demo"
  }
}
